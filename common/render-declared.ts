/**
 * The files generated from the declarations (error codes, daemon settings,
 * client constants and environment): the Python client's constants module and
 * the tables of docs/PROTOCOL.md and docs/CONFIGURATION.md, which are written
 * between markers so that the prose around them stays hand-written, and the
 * defaults other pages quote inline (`<!-- default:KEY -->256<!-- /default -->`).
 * scripts/gen-declared.js writes them (`npm run build`);
 * test/unit/declared.test.ts checks that the committed files are up to date.
 */
import { CLIENT_CONSTANTS } from './client-constants';
import { CLIENT_ENVIRONMENT } from './client-environment';
import { DAEMON_SETTINGS, type SettingDeclaration, shownDefault } from './daemon-settings';
import { type CodeSource, ERROR_CODES, type ErrorCodeDeclaration } from './error-codes';

/** A generated file: its path from the package root and how to make it from its current text. */
export interface GeneratedFile {
  path: string;
  render(current: string): string;
}

const SOURCE_TITLES: Record<CodeSource, string> = {
  daemon: "the daemon's refusals",
  backend: 'backend and operating-system errors, mapped to a status as they cross the wire',
  session: 'session-socket error frames (they answer no RPC)',
  client: 'made by the client libraries themselves',
};

/** `text` with what lies between `<!-- NAME:begin … -->` and `<!-- NAME:end -->` replaced by `body`. @throws Error when a marker is missing */
export function replaceBetween(text: string, name: string, body: string): string {
  const pattern = new RegExp(`(<!-- ${name}:begin[^>]*-->\\n)[\\s\\S]*?(<!-- ${name}:end -->)`);
  if (!pattern.test(text)) throw new Error(`no <!-- ${name}:begin --> … <!-- ${name}:end --> markers`);
  return text.replace(pattern, (_, begin: string, end: string) => `${begin}${body}${end}`);
}

/** `text` with each inline `<!-- default:KEY -->…<!-- /default -->` holding setting KEY's default as shown. @throws Error naming an unknown key */
export function fillDefaults(text: string): string {
  return text.replace(/(<!-- default:(\w+) -->)[^<]*(<!-- \/default -->)/g, (_, open: string, key: string, close: string) => {
    const setting = (DAEMON_SETTINGS as Record<string, SettingDeclaration>)[key];
    if (setting === undefined) throw new Error(`<!-- default:${key} --> names no setting`);
    return `${open}${shownDefault(setting) ?? 'none'}${close}`;
  });
}

const cell = (text: string) => text.replace(/\|/g, '\\|');

/** PROTOCOL.md's table of every code, grouped by who produces it. */
export function renderCodeTable(): string {
  const entries = Object.entries(ERROR_CODES) as Array<[string, ErrorCodeDeclaration]>;
  return (Object.keys(SOURCE_TITLES) as CodeSource[])
    .map((source) => {
      const rows = entries
        .filter(([, declared]) => declared.by === source)
        .map(([code, declared]) => `| \`${code}\` | ${declared.status} | ${cell(declared.meaning)} |`);
      return `**${SOURCE_TITLES[source]}**\n\n| code | status | meaning |\n| --- | --- | --- |\n${rows.join('\n')}\n`;
    })
    .join('\n');
}

const flagCell = (setting: SettingDeclaration) => `\`--${setting.flag} ${setting.placeholder.replace(/\|/g, '\\|')}\``;

/** CONFIGURATION.md's table of the daemon's settings. */
export function renderSettingsTable(): string {
  const rows = (Object.values(DAEMON_SETTINGS) as SettingDeclaration[]).map((setting) => {
    const bounds = setting.type === 'integer' ? ` (${setting.min} to ${setting.max})` : '';
    return `| ${flagCell(setting)} | \`${setting.env}\` | ${cell(shownDefault(setting) ?? 'none')} | ${cell(setting.doc ?? setting.help)}${bounds} |`;
  });
  return [
    '| flag | environment | default | meaning |',
    '| --- | --- | --- | --- |',
    '| `--config FILE` | `VMMD_CONFIG` | none | a JSON file of settings |',
    ...rows,
    '',
  ].join('\n');
}

/** CONFIGURATION.md's table of the clients' environment switches. */
export function renderClientEnvironment(): string {
  const reader = { both: '', typescript: 'TypeScript: ', python: 'Python: ' };
  const rows = Object.entries(CLIENT_ENVIRONMENT).map(
    ([name, declared]) => `| \`${name}\` | ${cell(declared.default)} | ${reader[declared.readBy]}${cell(declared.meaning)} |`,
  );
  return ['| variable | default | meaning |', '| --- | --- | --- |', ...rows, ''].join('\n');
}

const python = (value: string | number) => (typeof value === 'number' ? String(value) : JSON.stringify(value));

/** python/src/vmmd/_declared.py: the shared constants and every error code. */
export function renderPythonModule(): string {
  const constants = Object.entries(CLIENT_CONSTANTS).map(
    ([name, { value, meaning }]) => `# ${meaning[0].toUpperCase()}${meaning.slice(1)}.\n${name} = ${python(value)}`,
  );
  const codes = (Object.entries(ERROR_CODES) as Array<[string, ErrorCodeDeclaration]>).map(
    ([code, declared]) => `    ${python(code)}: (${python(declared.status)}, ${python(declared.by)}, ${python(declared.meaning)}),`,
  );
  return `"""Constants shared with the daemon and the TypeScript client, and every error code.

Generated by scripts/gen-declared.js from common/client-constants.ts and
common/error-codes.ts: edit those and run \`npm run build\`, not this file.
"""
# ruff: noqa: E501
from typing import Dict, Tuple

${constants.join('\n')}

# Every error code: name -> (gRPC status name, who produces it, meaning).
CODES: Dict[str, Tuple[str, str, str]] = {
${codes.join('\n')}
}
`;
}

/** Every generated file. */
export const GENERATED_FILES: readonly GeneratedFile[] = [
  { path: 'python/src/vmmd/_declared.py', render: () => renderPythonModule() },
  { path: 'docs/PROTOCOL.md', render: (current) => fillDefaults(replaceBetween(current, 'error-codes', renderCodeTable())) },
  { path: 'docs/OPERATIONS.md', render: (current) => fillDefaults(current) },
  {
    path: 'docs/CONFIGURATION.md',
    render: (current) => replaceBetween(replaceBetween(current, 'daemon-settings', renderSettingsTable()), 'client-environment', renderClientEnvironment()),
  },
];
