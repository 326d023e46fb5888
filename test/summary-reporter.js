// Prints the run's closing line in the plain form CI tools read:
// "tests: N passed, N failed, N skipped". Jest prints its own summary after
// the reporters run, so the line goes out as the process exits.
'use strict';

class SummaryReporter {
  onRunComplete(_contexts, results) {
    const skipped = results.numPendingTests + results.numTodoTests;
    const failed = results.numFailedTests + results.numRuntimeErrorTestSuites;
    const line = `tests: ${results.numPassedTests} passed, ${failed} failed, ${skipped} skipped\n`;
    process.once('exit', () => process.stderr.write(line));
  }
}

module.exports = SummaryReporter;
