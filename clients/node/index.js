'use strict';
// rlsidecar: the Node client of the rlsidecar rate-limiter daemon. See README.md.

const { Client } = require('./lib/client');
const { Decision, RuleDecision, PROBLEM_TYPE, COST_EXCEEDS_CAPACITY } = require('./lib/decision');
const { middleware, upgrade, defaultAttrs, peerIP, header } = require('./lib/middleware');
const { PROTOCOL, ProtocolError, RequestTooLargeError, ClosedError } = require('./lib/proto');
const { normalizePath } = require('./lib/path');

module.exports = {
  Client, Decision, RuleDecision, middleware, upgrade, defaultAttrs, peerIP, header, normalizePath, ProtocolError, RequestTooLargeError, ClosedError,
  PROTOCOL, PROBLEM_TYPE, COST_EXCEEDS_CAPACITY,
};
