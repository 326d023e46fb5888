/**
 * The reliability suite's figures: each test records what it measured here;
 * they are printed at the end of the file's run and appended, one JSON line
 * per figure, to $VMMD_FIGURES when set (npm run reliability collects them
 * for RELIABILITY.md).
 */
import * as fs from 'node:fs';

export function figure(name: string, values: Record<string, string | number | boolean>): void {
  const line = JSON.stringify({ name, ...values, date: new Date().toISOString() });
  console.log(`figure ${line}`);
  const file = process.env.VMMD_FIGURES;
  if (file) fs.appendFileSync(file, `${line}\n`);
}
