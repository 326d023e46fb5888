/**
 * The GPU suite, run from the compiled tests (dist/) so that an offline GPU
 * host needs neither TypeScript nor ts-jest: scripts/gpu-test.sh uses it.
 */
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/dist/test/gpu'],
  testMatch: ['**/*.test.js'],
  transform: {},
  testTimeout: 60000,
  maxWorkers: 1,
  verbose: true,
  reporters: ['default', '<rootDir>/test/summary-reporter.js'],
  setupFiles: ['<rootDir>/test/setup-symbols.js'],
};
