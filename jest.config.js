/** @type {import('jest').Config} */
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test'],
  testMatch: ['**/*.test.ts'],
  transform: {
    // Type checking is tsc's job (`npm run build` runs before jest); ts-jest only transpiles.
    '^.+\\.ts$': ['ts-jest', { diagnostics: false }],
  },
  testTimeout: 30000,
  // e2e suites start daemons and client processes: two at a time suits a 2-core machine.
  maxWorkers: 2,
  reporters: ['default', '<rootDir>/test/summary-reporter.js'],
  setupFiles: ['<rootDir>/test/setup-symbols.js'],
};
