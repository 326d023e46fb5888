/**
 * The declarations in common/ (error codes, daemon settings, client constants
 * and environment) and what is made from them: the compiler refuses a code
 * that is not declared or is used with another status, the generated files
 * are up to date, every setting's default lies within its bounds, and --help
 * names every setting.
 */
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { status as Status } from '@grpc/grpc-js';
import ts from 'typescript';
import { ERROR_CODES, isErrorCode } from '../../common/error-codes';
import { DAEMON_SETTINGS, type SettingDeclaration } from '../../common/daemon-settings';
import { GENERATED_FILES } from '../../common/render-declared';
import { CLIENT_ENVIRONMENT } from '../../common/client-environment';
import { MEMORY_MANAGER_VARIABLE } from '../../client/emm/plugin';
import { parseCommandLine, USAGE } from '../../server/app/config';
import { invalidArgument, outOfRange, RpcError, toServiceError } from '../../server/errors';

const ROOT = path.resolve(__dirname, '..', '..');

/** The compiler's errors for `source`, a file that imports the daemon's error helpers or the client's error class. */
function compileErrors(source: string): string[] {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-codes-'));
  const file = path.join(dir, 'refusals.ts');
  fs.writeFileSync(file, source.replace('SERVER_ERRORS', path.join(ROOT, 'server', 'errors')).replace('CLIENT_ERRORS', path.join(ROOT, 'client', 'errors')));
  const program = ts.createProgram([file], {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.CommonJS,
    esModuleInterop: true,
    types: ['node'],
    typeRoots: [path.join(ROOT, 'node_modules', '@types')],
  });
  const errors = ts.getPreEmitDiagnostics(program).filter((diagnostic) => diagnostic.file?.fileName === file);
  fs.rmSync(dir, { recursive: true, force: true });
  return errors.map(
    (diagnostic) =>
      `${diagnostic.file!.getLineAndCharacterOfPosition(diagnostic.start!).line + 1}: ${ts.flattenDiagnosticMessageText(diagnostic.messageText, ' ')}`,
  );
}

describe('error codes', () => {
  test('the compiler refuses a misspelt code and a code used with a status it is not declared with', () => {
    const errors = compileErrors(`import { invalidArgument, outOfRange, notFound, RpcError } from 'SERVER_ERRORS';
import { VmmdError } from 'CLIENT_ERRORS';
export const fine = [invalidArgument('ZERO_SIZE', 'x'), outOfRange('ALIGNMENT_TOO_LARGE', 'x'), notFound('NOT_RESERVED', 'x')];
export const misspelt = invalidArgument('ZERO_SIZ', 'x');
export const otherStatus = outOfRange('BAD_ALIGNMENT', 'x');
export const undeclared = new RpcError(13, 'NO_SUCH_CODE', 'x');
export const clientFine = new VmmdError('SESSION_LOST', 14, 'x');
export const clientMisspelt = new VmmdError('SESSION_LOS', 14, 'x');
`);
    expect(errors).toEqual([
      expect.stringMatching(/^4: .*"ZERO_SIZ"/),
      expect.stringMatching(/^5: .*"BAD_ALIGNMENT"/),
      expect.stringMatching(/^6: .*"NO_SUCH_CODE"/),
      expect.stringMatching(/^8: .*"SESSION_LOS"/),
    ]);
  }, 60_000);

  test('each code has a gRPC status and a meaning', () => {
    for (const [code, declared] of Object.entries(ERROR_CODES)) {
      expect([code, typeof Status[declared.status]]).toEqual([code, 'number']);
      expect(declared.meaning.length).toBeGreaterThan(10);
    }
  });

  test('a refusal carries the status its code is declared with', () => {
    expect(invalidArgument('BAD_ALIGNMENT', 'x')).toMatchObject({ status: Status.INVALID_ARGUMENT, code: 'BAD_ALIGNMENT' });
    expect(outOfRange('ALIGNMENT_TOO_LARGE', 'x')).toMatchObject({ status: Status.OUT_OF_RANGE });
    expect(new RpcError(Status.NOT_FOUND, 'UNKNOWN_STORE', 'x').code).toBe('UNKNOWN_STORE');
  });

  test('a backend error with a declared code answers with its status; an undeclared one is INTERNAL', () => {
    const coded = (code: string) => toServiceError(Object.assign(new Error('m'), { code }));
    expect(coded('UNSUPPORTED_HANDLE_TYPE').code).toBe(Status.FAILED_PRECONDITION);
    expect(coded('BAD_DESCRIPTOR').code).toBe(Status.INVALID_ARGUMENT);
    expect(coded('ENOBUFS').code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(coded('CUDA_ERROR_UNKNOWN').code).toBe(Status.INTERNAL);
    expect(isErrorCode('ZERO_SIZE') && !isErrorCode('toString')).toBe(true);
  });
});

describe('settings', () => {
  test.each(Object.entries(DAEMON_SETTINGS) as Array<[string, SettingDeclaration]>)('%s has a default within its bounds', (key, setting) => {
    if (setting.type === 'integer' && setting.default !== undefined) {
      expect(setting.default).toBeGreaterThanOrEqual(setting.min);
      expect(setting.default).toBeLessThanOrEqual(setting.max);
    }
    if (setting.type === 'bytes' && setting.default !== undefined) expect(setting.default >= setting.min).toBe(true);
    if (setting.type === 'choice') expect(setting.choices).toContain(setting.default);
    // The daemon starts on every default and takes it as declared.
    const parsed = parseCommandLine([], { VMMD_SOCKET_DIR: '/tmp/x' }, 4096);
    if (parsed.kind !== 'run') throw new Error('expected run');
    const value = (parsed.config as unknown as Record<string, unknown>)[key];
    if (setting.default !== undefined && !key.startsWith('tls') && key !== 'stock') expect(value).toEqual(setting.default);
  });

  test('--help names every setting: its flag, placeholder and environment variable', () => {
    for (const setting of Object.values(DAEMON_SETTINGS) as SettingDeclaration[]) {
      expect(USAGE).toContain(`--${setting.flag} ${setting.placeholder}`);
      expect(USAGE).toContain(`[env ${setting.env}]`);
    }
  });

  test('every flag and environment variable is named once', () => {
    const settings = Object.values(DAEMON_SETTINGS) as SettingDeclaration[];
    expect(new Set(settings.map((setting) => setting.flag)).size).toBe(settings.length);
    expect(new Set(settings.map((setting) => setting.env)).size).toBe(settings.length);
  });
});

describe("the TypeScript client's own refusals", () => {
  /**
   * Codes the client still raises with a status other than their declared one,
   * each for a reason: the status follows the errno of a failed map, or one code
   * covers a malformed and an out-of-range argument. New ones are not welcome.
   */
  const SEVERAL_STATUSES: Record<string, string[]> = {
    LOCAL_MAP_FAILED: ['PERMISSION_DENIED', 'RESOURCE_EXHAUSTED'],
    BAD_SHAPE: ['OUT_OF_RANGE'],
    BAD_INDEX: ['OUT_OF_RANGE'],
    BAD_DEVICE: ['NOT_FOUND'],
    UNKNOWN_SESSION: ['NOT_FOUND'],
  };

  test('each is raised with its declared status (or one of the few listed exceptions)', () => {
    const files = (dir: string): string[] =>
      fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => (entry.isDirectory() ? files(path.join(dir, entry.name)) : [path.join(dir, entry.name)]));
    const raised = files(path.join(ROOT, 'client')).flatMap((file) => [
      ...fs.readFileSync(file, 'utf8').matchAll(/new VmmdError\(\s*'([A-Z_]+)',\s*(?:grpc\.status|Status)\.([A-Z_]+)/g),
    ]);
    expect(raised.length).toBeGreaterThan(40);
    const other = raised
      .filter(([, code, status]) => ERROR_CODES[code as keyof typeof ERROR_CODES].status !== status && !SEVERAL_STATUSES[code]?.includes(status))
      .map(([, code, status]) => `${code} ${status}`);
    expect(other).toEqual([]);
  });
});

describe('client environment', () => {
  /** The files of a folder, recursively, whose names end in `suffix`. */
  const files = (dir: string, suffix: string): string[] =>
    fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
      const file = path.join(dir, entry.name);
      return entry.isDirectory() ? files(file, suffix) : file.endsWith(suffix) ? [file] : [];
    });

  test('every variable the clients read is in common/client-environment.ts', () => {
    const sources = [...files(path.join(ROOT, 'client'), '.ts'), ...files(path.join(ROOT, 'common'), '.ts'), ...files(path.join(ROOT, 'python', 'src'), '.py')];
    const read = new Set<string>();
    const reads = /process\.env\.([A-Z_]+)|process\.env\[([A-Z_]+)\]|environ\.get\("([A-Z_]+)"|env\.get\("([A-Z_]+)"|env\["([A-Z_]+)"\]|\benv\.([A-Z_]{4,})/g;
    for (const file of sources) {
      for (const match of fs.readFileSync(file, 'utf8').matchAll(reads)) read.add(match.slice(1).find((name) => name !== undefined)!);
    }
    read.delete('MEMORY_MANAGER_VARIABLE');
    read.add(MEMORY_MANAGER_VARIABLE);
    expect(read.size).toBeGreaterThan(8);
    expect([...read].filter((name) => !(name in CLIENT_ENVIRONMENT))).toEqual([]);
  });
});

describe('generated files', () => {
  test.each(GENERATED_FILES.map((file) => [file.path, file] as const))('%s is up to date (npm run build writes it)', (where, file) => {
    const current = fs.readFileSync(path.join(ROOT, where), 'utf8');
    expect(file.render(current)).toBe(current);
  });
});
