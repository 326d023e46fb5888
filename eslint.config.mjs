// Lint rules for the TypeScript sources (`npm run lint`, part of `npm test`): typescript-eslint's
// recommended set, and no source file of the daemon, the client, the addon's loader or common code
// over 500 lines (a file that grows past it holds more than one job: split it by concern). Tests and
// CommonJS scripts may require() (compiled code under dist/, modules named at run time) and use `any`
// for the shapes they attack with. Layout is Prettier's (prettier.config.mjs): eslint-config-prettier,
// last, turns off every rule that would disagree with it.
import prettier from 'eslint-config-prettier/flat';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['dist/**', 'generated/**', 'node_modules/**', 'build/**', 'python/**', '.venv/**', '.gpu/**', 'prebuilds/**', 'bench/probe/**'] },
  ...tseslint.configs.recommended,
  {
    rules: {
      '@typescript-eslint/no-unused-vars': [
        'error',
        { argsIgnorePattern: '^_', varsIgnorePattern: '^_', caughtErrorsIgnorePattern: '^_', destructuredArrayIgnorePattern: '^_' },
      ],
    },
  },
  {
    files: ['server/**/*.ts', 'client/**/*.ts', 'common/**/*.ts', 'native/**/*.ts'],
    rules: { 'max-lines': ['error', { max: 500, skipBlankLines: false, skipComments: false }] },
  },
  {
    files: ['test/**', '**/*.js', '**/*.cjs'],
    rules: { '@typescript-eslint/no-require-imports': 'off', '@typescript-eslint/no-explicit-any': 'off' },
  },
  prettier,
);
