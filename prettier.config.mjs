// Prettier's layout for the TypeScript and JavaScript sources (`npm run format` writes it,
// `npm run lint` checks it). 160 columns: the tree was written to about that width (TSDoc lines,
// one-line guards with their refusal message), and at 120 Prettier would break thousands of such
// lines, growing the tree by a sixth and several files past the 500-line limit. Single quotes,
// trailing commas and parenthesised arrow parameters, as the code already reads.
/** @type {import('prettier').Config} */
export default {
  printWidth: 160,
  singleQuote: true,
  trailingComma: 'all',
  arrowParens: 'always',
};
