/**
 * Samples and their summaries: every benchmark row is a set of per-operation
 * latencies (µs) turned into p50, p99 and operations per second.
 */

export interface Summary {
  n: number;
  p50_us: number;
  p99_us: number;
  mean_us: number;
  ops_s: number;
}

const round = (value: number, digits = 1) => +value.toFixed(digits);

export function percentile(sorted: ArrayLike<number>, p: number): number {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

/** The summary of latencies in µs; ops_s is 1e6 over the mean (one caller at a time). */
export function summarize(samples: number[]): Summary {
  const sorted = Float64Array.from(samples).sort();
  let total = 0;
  for (const sample of samples) total += sample;
  const mean = total / Math.max(1, samples.length);
  return {
    n: samples.length,
    p50_us: round(percentile(sorted, 50), 2),
    p99_us: round(percentile(sorted, 99), 2),
    mean_us: round(mean, 2),
    ops_s: Math.round(1e6 / mean),
  };
}

const now = () => performance.now() * 1000;

/**
 * Runs `body` `iterations` times after `warmup` untimed runs, one at a time,
 * timing each; `after` (untimed) runs after each timed call with its result.
 */
export async function sample<T>(
  iterations: number,
  body: () => Promise<T>,
  options: { warmup?: number; after?: (value: T) => Promise<unknown> | unknown } = {},
): Promise<number[]> {
  const warmup = options.warmup ?? Math.min(50, iterations);
  for (let i = 0; i < warmup; i++) {
    const value = await body();
    await options.after?.(value);
  }
  const samples = new Array<number>(iterations);
  for (let i = 0; i < iterations; i++) {
    const start = now();
    const value = await body();
    samples[i] = now() - start;
    await options.after?.(value);
  }
  return samples;
}

/** As sample(), for synchronous bodies. */
export function sampleSync<T>(iterations: number, body: () => T, after?: (value: T) => unknown, warmup = Math.min(50, iterations)): number[] {
  for (let i = 0; i < warmup; i++) after?.(body());
  const samples = new Array<number>(iterations);
  for (let i = 0; i < iterations; i++) {
    const start = now();
    const value = body();
    samples[i] = now() - start;
    after?.(value);
  }
  return samples;
}

/** A row of a benchmark's table: what was measured, and its numbers. */
export type Row = Record<string, string | number | boolean | null>;

export interface Section {
  id: string;
  title: string;
  rows: Row[];
  /** Targets checked against this section's rows: what, the value, the limit, met or not. */
  targets?: Target[];
  notes?: string[];
}

export interface Target {
  target: string;
  measured: string;
  limit: string;
  met: boolean;
}

/** A markdown table of rows (the union of their keys, in first-seen order). */
export function markdownTable(rows: Row[]): string {
  const keys: string[] = [];
  for (const row of rows) for (const key of Object.keys(row)) if (!keys.includes(key)) keys.push(key);
  const cell = (value: unknown) => (value === undefined || value === null ? '' : String(value));
  return [
    `| ${keys.join(' | ')} |`,
    `| ${keys.map(() => '---').join(' | ')} |`,
    ...rows.map((row) => `| ${keys.map((key) => cell(row[key])).join(' | ')} |`),
  ].join('\n');
}

export function ratio(value: number, reference: number): number {
  return round(value / reference, 2);
}
