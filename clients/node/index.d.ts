// TypeScript declarations of the rlsidecar Node client.

/// <reference types="node" />

export declare const PROTOCOL: 1;
export declare const PROBLEM_TYPE: 'about:blank';
export declare const COST_EXCEEDS_CAPACITY: 'cost_exceeds_capacity';

/** An inline limit, checked together with the rules the attributes match. */
export interface InlineLimit {
  key: string;
  limit: number | bigint;
  windowMs: number | bigint;
  burst?: number | bigint;
  algorithm?: 'token_bucket' | 'sliding_window' | 'fixed_window';
  mode?: 'local' | 'hybrid' | 'global';
  name?: string;
}

export interface ClientOptions {
  /** Path of the sidecar's Unix socket. */
  socket: string;
  /** Longest wait for one check, in milliseconds (> 0, at most 2^31 - 1); default 50. */
  timeoutMs?: number;
  /** The decision when the sidecar gives no answer in time; default 'open'. */
  onUnavailable?: 'open' | 'closed';
  /** Connections in the pool, each pipelined; default 2. */
  conns?: number;
  /** Longest wait for one connection attempt, in milliseconds (> 0, at most 2^31 - 1); default max(timeoutMs, 100). */
  connectTimeoutMs?: number;
  /**
   * The largest request frame body sent, in bytes; default 65536. Set it to the daemon's
   * --max-frame. A request over it is not sent: check() rejects with a RequestTooLargeError.
   */
  maxFrame?: number;
  /**
   * Where the outage log goes: a warning when a first check is decided by onUnavailable
   * because the sidecar gave no answer, at most one per 10 s while that goes on, one when
   * it answers again. Default console (console.warn, stderr); null: no outage log.
   */
  logger?: { warn(message: string): void } | null;
}

export interface CheckOptions {
  /** What the request consumes; default 1; 0 asks without consuming. */
  cost?: number | bigint;
  limits?: InlineLimit[];
}

export declare class RuleDecision {
  readonly name: string;
  readonly limit: number;
  readonly windowMs: number;
  readonly remaining: number;
  readonly resetMs: number;
  readonly retryAfterMs: number;
  readonly allowed: boolean;
  readonly shadow: boolean;
  readonly reason: '' | 'cost_exceeds_capacity' | string;
  /** Allowed, and the rule has used at least its warn_at fraction. */
  readonly warning: boolean;
  /** Allowed, but conforming to this rule only after this wait (a rule's delay). */
  readonly delayMs: number;
  /** The key is banned by this rule (its penalty). */
  readonly banned: boolean;
  /**
   * The request was refused before this rule's store was asked: it refused nothing, and
   * its remaining and resetMs are 0 because they were not read (headers(): a RateLimit-Policy
   * item, no RateLimit item).
   */
  readonly unasked: boolean;
  /**
   * A concurrency rule's entry: limit is its max of requests in flight, remaining its
   * free slots, windowMs its lease (headers(): qu="concurrent-requests", no window).
   */
  readonly concurrency: boolean;
  /** Decided by its failure policy (on_store_failure), without the store it needed. */
  readonly degraded: boolean;
}

export interface Rejection {
  status: 429 | 431 | 503;
  headers: Record<string, string>;
  body: Buffer;
}

export interface Problem {
  type: string;
  title: string;
  status: number;
  detail: string;
  rule?: string;
  retry_after?: number;
}

export declare class Decision {
  readonly allowed: boolean;
  /** The deciding rule; '' when nothing decided. */
  readonly rule: string;
  readonly limit: number;
  readonly remaining: number;
  readonly resetMs: number;
  readonly retryAfterMs: number;
  /** The sidecar decided without its store, or this client applied onUnavailable. */
  readonly degraded: boolean;
  readonly rules: RuleDecision[];
  readonly reason: '' | 'cost_exceeds_capacity' | string;
  /** Allowed, and a rule has used at least its warn_at fraction: log or notify. */
  readonly warning: boolean;
  /** Allowed: hold the request this long before forwarding it (middleware does). */
  readonly delayMs: number;
  /** Refused because the deciding rule bans the key; retryAfterMs is the ban's rest. */
  readonly banned: boolean;
  /** This client applied onUnavailable: the sidecar gave no answer. */
  readonly unreachable: boolean;
  /** Why this client applied onUnavailable, else null. */
  readonly cause: string | null;
  /** The concurrency lease an allowed check holds; '' when none. Release it with Client.release. */
  readonly lease: string;
  /** The request was too large to check: rejected whatever onUnavailable; its HTTP form is a 431. */
  readonly tooLarge: boolean;
  /** 200, 429 (a rule rejected), 431 (too large to check) or 503 (no answer under 'closed'). */
  readonly status: 200 | 429 | 431 | 503;
  /** RateLimit-Policy, RateLimit, (when allowed and a rule warns) RateLimit-Warning and (when rejected) Retry-After. */
  headers(): Record<string, string>;
  problem(): Problem | null;
  rejection(): Rejection | null;
}

export declare class ProtocolError extends Error {
  readonly code: string;
  readonly sidecarMessage: string;
  /** The onUnavailable decision, for a caller that carries on. */
  readonly decision?: Decision;
}

/** The request was not sent: its frame body would be size bytes, more than maxFrame. */
export declare class RequestTooLargeError extends Error {
  readonly code: 'request_too_large';
  readonly size: number;
  readonly maxFrame: number;
  /** For a check: a Decision that rejects whatever onUnavailable (tooLarge, status 431). */
  readonly decision?: Decision;
}

export declare class ClosedError extends Error {}

export declare class Client {
  constructor(options: ClientOptions);
  readonly socket: string;
  readonly timeoutMs: number;
  readonly onUnavailable: 'open' | 'closed';
  /**
   * attrs: strings, sent in key order; a Uint8Array value (normalizePath's Buffer) is sent as its bytes;
   * an undefined or null value (a header the request lacks) leaves the attribute out.
   */
  check(attrs: Record<string, string | Uint8Array | undefined | null>, options?: CheckOptions): Promise<Decision>;
  ping(): Promise<string>;
  /** Frees a concurrency lease: false when it was unknown, expired or already released, or when the sidecar is unreachable or slow or the client closed (it then expires, or goes with its connection). Call it in a finally: it rejects only for an error answer. */
  release(lease: string): Promise<boolean>;
  /** Extends a live lease to leaseMs from now (0: each rule's own lease). */
  renew(lease: string, leaseMs?: number): Promise<{ renewed: boolean; expiresMs: number }>;
  close(): Promise<void>;
}

export interface MiddlewareRequest {
  method?: string;
  url?: string;
  originalUrl?: string;
  socket?: { remoteAddress?: string };
}

export interface MiddlewareResponse {
  statusCode: number;
  setHeader(name: string, value: string): unknown;
  end(body?: Buffer): unknown;
}

export interface MiddlewareOptions<Req extends MiddlewareRequest = MiddlewareRequest, Res extends MiddlewareResponse = MiddlewareResponse> {
  attrs?: (req: Req) => Record<string, string | Uint8Array | undefined | null>;
  cost?: (req: Req) => number;
  onError?: (err: unknown, req: Req, res: Res, next: (err?: unknown) => void) => void;
  /** Renew a request's concurrency lease until it is released (default true): a request longer than its rule's lease keeps its slot. */
  renewLeases?: boolean;
}

/**
 * ip (peerIP of the peer's address; left out when the request has none, as on a server
 * listening on a Unix socket), method, and path: normalizePath(req.originalUrl || req.url).
 */
export declare function defaultAttrs(req: MiddlewareRequest): { ip?: string; method: string; path: string | Buffer };

/**
 * The value of request header name ('x-user') for an attribute, undefined when the
 * request has none: the bytes the client sent (req.headers holds them read as latin-1),
 * a string when they are UTF-8, else a Buffer of them.
 */
export declare function header(req: { headers?: Record<string, string | string[] | undefined> }, name: string): string | Buffer | undefined;

/**
 * The ip attribute of a peer address: the address, except that an IPv4-mapped IPv6 one
 * ('::ffff:203.0.113.7', an IPv4 client of a dual-stack server) is its IPv4 address
 * (clients/testdata/ips.json).
 */
export declare function peerIP(addr: string): string;

/**
 * The path attribute of a request target, as every rlsidecar client sends it: the query
 * and fragment dropped, each valid %XX decoded once, slashes merged, dot segments removed
 * (clients/testdata/paths.json). A string when its bytes are UTF-8, else a Buffer of them.
 */
export declare function normalizePath(target: string): string | Buffer;

export declare function middleware<Req extends MiddlewareRequest = MiddlewareRequest, Res extends MiddlewareResponse = MiddlewareResponse>(
  client: Client,
  options?: MiddlewareOptions<Req, Res>,
): (req: Req, res: Res, next: (err?: unknown) => void) => void;

export interface UpgradeOptions<Req extends MiddlewareRequest = MiddlewareRequest> {
  attrs?: (req: Req) => Record<string, string | Uint8Array | undefined | null>;
  cost?: (req: Req) => number;
  /** Renew a session's concurrency lease until its socket closes (default true). */
  renewLeases?: boolean;
}

/**
 * A listener for an http.Server's 'upgrade' event (WebSocket handshakes, which the
 * middleware never sees): checks the handshake as a request; refused, writes the 429
 * (503, 431) on the socket and closes it; allowed, calls handler with the decision (its
 * headers() for the 101). A concurrency lease is held, renewed, until the socket closes.
 */
export declare function upgrade<Req extends MiddlewareRequest = MiddlewareRequest, Sock extends import('net').Socket = import('net').Socket>(
  client: Client,
  handler: (req: Req, socket: Sock, head: Buffer, decision: Decision) => void,
  options?: UpgradeOptions<Req>,
): (req: Req, socket: Sock, head: Buffer) => void;
