/**
 * Writes the results of bench/results/*.json into BENCHMARKS.md, between the
 * markers <!-- results:start --> and <!-- results:end -->; the rest of the
 * file (how to run, the analysis) is written by hand.
 *   node dist/bench/report.js [--targets-only] [BENCHMARKS.md [NAME ...]]
 * NAMEs pick result files (bench/results/NAME.json) in that order; without
 * them, every result file of the Node bench (those with sections) is written.
 * --targets-only writes each result's targets (met or missed) and not its
 * sections' tables, which stay in the result file.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';
import { packageRoot } from './lib/daemon';
import { markdownTable, Section } from './lib/stats';

interface Report {
  backend: string;
  machine: string;
  gpu?: string;
  node: string;
  date: string;
  commit: string;
  command: string;
  seconds: number;
  sections: Section[];
}

const START = '<!-- results:start -->';
const END = '<!-- results:end -->';

function render(name: string, report: Report, targetsOnly: boolean): string {
  const lines = [
    `### ${name}: ${report.backend} backend`,
    '',
    `- machine: ${report.machine}${report.gpu ? `; ${report.gpu}` : ''}`,
    `- date: ${report.date}, commit ${report.commit}, Node ${report.node}, ${report.seconds} s`,
    `- command: \`${report.command}\``,
    '',
  ];
  const targets = report.sections.flatMap((section) => section.targets ?? []);
  if (targets.length > 0) {
    lines.push(
      markdownTable(targets.map((target) => ({ target: target.target, measured: target.measured, limit: target.limit, met: target.met ? 'yes' : '**no**' }))),
      '',
    );
  }
  for (const section of targetsOnly ? [] : report.sections) {
    lines.push(`#### ${section.title}`, '', markdownTable(section.rows), '');
    for (const note of section.notes ?? []) lines.push(`- ${note}`);
    if ((section.notes ?? []).length > 0) lines.push('');
  }
  return lines.join('\n');
}

function main() {
  const targetsOnly = process.argv.includes('--targets-only');
  const args = process.argv.slice(2).filter((arg) => arg !== '--targets-only');
  const file = args[0] ?? path.join(packageRoot, 'BENCHMARKS.md');
  const dir = path.join(packageRoot, 'bench', 'results');
  const picked = args.slice(1).map((name) => `${name}.json`);
  const names =
    picked.length > 0
      ? picked
      : fs
          .readdirSync(dir)
          .filter((entry) => entry.endsWith('.json'))
          .sort();
  const reports = names
    .map((entry) => ({ name: entry.replace(/\.json$/, ''), report: JSON.parse(fs.readFileSync(path.join(dir, entry), 'utf8')) as Report }))
    .filter(({ report }) => Array.isArray(report.sections)); // the Python benches' results have a form of their own
  const body = reports.map(({ name, report }) => render(name, report, targetsOnly)).join('\n');
  const text = fs.readFileSync(file, 'utf8');
  const start = text.indexOf(START);
  const end = text.indexOf(END);
  if (start < 0 || end < start) throw new Error(`${file} has no ${START} … ${END} markers`);
  fs.writeFileSync(file, `${text.slice(0, start + START.length)}\n\n${body}\n${text.slice(end)}`);
  process.stdout.write(`report: ${reports.length} result file(s) written into ${file}\n`);
}

main();
