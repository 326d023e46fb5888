// Node 20 defines Symbol.dispose and Symbol.asyncDispose in the main realm as
// Symbol.for('nodejs.dispose') and Symbol.for('nodejs.asyncDispose'); jest's
// test realm lacks them. The registry symbols are shared by every realm, so
// this gives tests the very symbols Node uses.
'use strict';
if (typeof Symbol.dispose !== 'symbol') Object.defineProperty(Symbol, 'dispose', { value: Symbol.for('nodejs.dispose') });
if (typeof Symbol.asyncDispose !== 'symbol') {
  Object.defineProperty(Symbol, 'asyncDispose', { value: Symbol.for('nodejs.asyncDispose') });
}
