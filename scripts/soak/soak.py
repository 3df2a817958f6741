"""Soak of one rlsidecar daemon on a real redis-server, or a 3-master Redis Cluster with
CLUSTER=1 (scripts/soak/run builds both paths; not part of CI: it runs for minutes).

Load, for DUR seconds: checks of every rule kind and mode in rules.yaml over a key space
that keeps growing (local, hybrid, global; bans; delay; a calendar quota; inline limits
in every algorithm and mode), on the socket and on the Envoy rate limit API (envoyload/,
gRPC calls, some cancelled, and raw connections reset), concurrency leases acquired then
released, renewed or abandoned on connections closed, connections opened and closed
abruptly (half frames, garbage, RST), the rules reloaded every second (windows, limits,
an algorithm and a mode changed, a rule removed, one renamed at every reload, now and
then a broken file), and Redis frozen (SIGSTOP for 3 s) or restarted every 20 s. Then
IDLE seconds of nothing. Every 5 s it samples the daemon's goroutines (pprof), open FDs,
RSS, its gauges, the series on /metrics, Redis's key count and the keys without a TTL.

It fails when a Redis key has no TTL at any sample, or when, after the idle time, the
goroutines, connections, leases in flight or the sync backlog are not back to their
baseline. The daemon's client keys are reported, not checked: a calendar quota's local
fallback state (made while Redis was away) is kept until its window ends, by design.
"""
import os, sys, time, socket, subprocess, random, threading, signal, re, tempfile, urllib.request
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', '..', 'clients', 'python'))
import rlsidecar

def free_port():
    s = socket.socket(); s.bind(('127.0.0.1', 0)); p = s.getsockname()[1]; s.close(); return p
D = os.environ.get('DIR') or tempfile.mkdtemp(prefix='rlsidecar-soak-')
os.makedirs(D, exist_ok=True)
BIN = os.environ['RLSIDECAR_BIN']
DUR = int(os.environ.get('DUR', '180')); IDLE = int(os.environ.get('IDLE', '60'))
rport = free_port(); aport = free_port(); pport = free_port(); eport = free_port()
sock = D + '/rl.sock'; cfg = D + '/rules.yaml'
base = open(os.path.join(HERE, 'rules.yaml')).read()

# CLUSTER=1: a 3-master Redis Cluster instead (each node's port + 10000, its bus port,
# free too); the chaos then freezes or restarts one master at a time.
CLUSTER = os.environ.get('CLUSTER') == '1'
def cluster_port():
    while True:
        p = free_port()
        if p < 50000:
            b = socket.socket()
            try:
                b.bind(('127.0.0.1', p + 10000))
                return p
            except OSError:
                pass
            finally:
                b.close()
ports = [cluster_port() for _ in range(3)] if CLUSTER else [rport]
def start_redis(p):
    args = ['redis-server', '--port', str(p), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no']
    if CLUSTER:
        os.makedirs('%s/n%d' % (D, p), exist_ok=True)
        args += ['--cluster-enabled', 'yes', '--cluster-node-timeout', '60000', '--dir', '%s/n%d' % (D, p)]
    return subprocess.Popen(args, stdout=open('%s/redis%d.log' % (D, p), 'a'))
nodes = {p: start_redis(p) for p in ports}
time.sleep(0.7)
if CLUSTER:
    subprocess.run(['redis-cli', '--cluster', 'create'] + ['127.0.0.1:%d' % p for p in ports] + ['--cluster-yes'],
                   capture_output=True, check=True, timeout=30)
    time.sleep(2)
def rc(*a):
    """A Redis command on every node: the sum of their integer replies ('' if one failed)."""
    tot = 0
    for p in ports:
        out = subprocess.run(['redis-cli', '-p', str(p)] + list(a), capture_output=True, text=True, timeout=10).stdout.strip()
        try:
            tot += int(out)
        except ValueError:
            return ''
    return str(tot)

def variant(i):
    r = base
    if i % 2 == 1:
        r = r.replace('per: 2s', 'per: 3s').replace('requests: 3,', 'requests: 4,')
        r = r.replace('algorithm: sliding_window', 'algorithm: fixed_window', 1)
        r = r.replace("match: { k: hy }\n    limit: { requests: 4, per: 3s }\n    mode: hybrid", "match: { k: hy }\n    limit: { requests: 4, per: 3s }\n    mode: global")
        r = r.replace('lease: 2s', 'lease: 3s')
        r = r.replace('penalty: { after: 2, within: 2s, ban: 1s, factor: 2, max: 3s }', 'penalty: { after: 3, within: 3s, ban: 1s, max: 4s }')
        # drop the quota rule
        r = r.split('  - name: quota')[0]
    # a rule whose name changes at every reload
    r += '  - name: churn-%d\n    key: u\n    match: { k: churn }\n    limit: { requests: 2, per: 2s }\n    mode: hybrid\n' % i
    return r
open(cfg, 'w').write(variant(0))
env = dict(os.environ, SOAK_PPROF='127.0.0.1:%d' % pport)
dm = subprocess.Popen([BIN, 'serve', '--config', cfg, '--socket', sock, *(['--redis-cluster', ','.join('127.0.0.1:%d' % p for p in ports)] if CLUSTER else
                         ['--redis', 'redis://127.0.0.1:%d' % rport]),
                       '--admin', '127.0.0.1:%d' % aport, '--sweep-interval', '1s', '--envoy-rls', '127.0.0.1:%d' % eport],
                      stdout=open(D + '/daemon.log', 'w'), stderr=subprocess.STDOUT, env=env)
for _ in range(100):
    if os.path.exists(sock): break
    time.sleep(0.1)
time.sleep(1)

def get(url):
    try: return urllib.request.urlopen(url, timeout=5).read().decode()
    except Exception as e: return ''
def sample():
    s = {}
    g = get('http://127.0.0.1:%d/debug/pprof/goroutine?debug=1' % pport)
    m = re.search(r'total (\d+)', g); s['gor'] = int(m.group(1)) if m else -1
    try: s['fds'] = len(os.listdir('/proc/%d/fd' % dm.pid))
    except Exception: s['fds'] = -1
    try:
        st = open('/proc/%d/status' % dm.pid).read()
        s['rss_kb'] = int(re.search(r'VmRSS:\s+(\d+)', st).group(1))
    except Exception: s['rss_kb'] = -1
    met = get('http://127.0.0.1:%d/metrics' % aport)
    lines = [l for l in met.split('\n') if l and not l.startswith('#')]
    s['mlines'] = len(lines)
    s['top'] = sum(1 for l in lines if l.startswith('rlsidecar_top_rejected'))
    for l in lines:
        name = l.split(' ')[0]
        if name.split('{')[0] in ('rlsidecar_keys', 'rlsidecar_connections', 'rlsidecar_hybrid_sync_backlog',
                                  'rlsidecar_breaker_open', 'rlsidecar_store_unreachable', 'rlsidecar_breaker_open_masters'):
            s[name.replace('rlsidecar_', '')] = float(l.split(' ')[-1])
        if name.startswith('rlsidecar_inflight') or name.startswith('rlsidecar_banned_keys'):
            s[name.replace('rlsidecar_', '')] = float(l.split(' ')[-1])
    s['rkeys'] = rc('DBSIZE')
    s['nottl'] = rc('EVAL', "local c=0 for _,k in ipairs(redis.call('KEYS','*')) do if redis.call('PTTL',k)==-1 then c=c+1 end end return c", '0')
    return s

samples = []
stop = threading.Event(); chaos_stop = threading.Event()
def sampler():
    t0 = time.time()
    while not chaos_stop.is_set() or time.time() - t0 < DUR + IDLE:
        if time.time() - t0 > DUR + IDLE: break
        s = sample(); s['t'] = round(time.time() - t0)
        samples.append(s); print('S', s, flush=True)
        time.sleep(5)
errs = {'n': 0}
def checker(seed):
    rnd = random.Random(seed); c = None; n = 0
    kinds = os.environ.get('KINDS', 'loc,hy,gl,hyban,glban,delay,quota,churn').split(',')
    while not stop.is_set():
        try:
            if c is None: c = rlsidecar.Client(sock, timeout=0.5)
            k = rnd.choice(kinds)
            u = 'c%d-%d' % (seed, rnd.randint(0, 5000)) if rnd.random() < 0.5 else 'hot%d' % rnd.randint(0, 20)
            c.check({'k': k, 'u': u})
            if rnd.random() < 0.2:
                alg = rnd.choice(['token_bucket', 'sliding_window', 'fixed_window'])
                c.check({}, limits=[{'key': 'in%d' % rnd.randint(0, 3000), 'limit': 3, 'window_ms': 2000, 'algorithm': alg,
                                     'mode': rnd.choice(['local', 'hybrid', 'global'])}])
            n += 1
            if n % 500 == 0: c.close(); c = None
        except Exception as e:
            errs['n'] += 1; time.sleep(0.01)
            try: c.close()
            except Exception: pass
            c = None
def leaser(seed):
    rnd = random.Random(seed)
    while not stop.is_set():
        try:
            c = rlsidecar.Client(sock, timeout=0.5)
            for _ in range(rnd.randint(1, 20)):
                d = c.check({'k': rnd.choice(['conc', 'lconc']), 'u': 'l%d' % rnd.randint(0, 200)})
                if d.lease:
                    x = rnd.random()
                    if x < 0.4: c.release(d.lease)
                    elif x < 0.5: c.renew(d.lease, 2000)
            c.close()  # abandoned leases on a closed connection
        except Exception as e:
            errs['n'] += 1; time.sleep(0.01)
def rude(seed):
    rnd = random.Random(seed)
    while not stop.is_set():
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(sock)
            x = rnd.random()
            if x < 0.3: s.send(b'\x00\x00\x01\x00abc')    # half a frame
            elif x < 0.6: s.send(os.urandom(rnd.randint(1, 64)))
            if rnd.random() < 0.5: s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b'\x01\x00\x00\x00\x00\x00\x00\x00')
            s.close()
        except Exception: pass
        time.sleep(0.02)
def reloader():
    i = 0
    while not stop.is_set():
        i += 1
        txt = variant(i)
        if i % 17 == 0: txt = 'rules: [ broken'
        open(cfg + '.tmp', 'w').write(txt); os.rename(cfg + '.tmp', cfg)
        time.sleep(1)
    open(cfg + '.tmp', 'w').write(variant(0)); os.rename(cfg + '.tmp', cfg)
def chaos():
    i = 0
    while not stop.wait(20):
        i += 1
        p = ports[i % len(ports)]
        if i % 2 == 1:
            print('C freeze redis', p, flush=True)
            nodes[p].send_signal(signal.SIGSTOP); time.sleep(3); nodes[p].send_signal(signal.SIGCONT)
        else:
            print('C restart redis', p, flush=True)
            nodes[p].kill(); nodes[p].wait(); time.sleep(2); nodes[p] = start_redis(p)

base_s = sample(); print('BASE', base_s, flush=True)
ths = [threading.Thread(target=f, args=a) for f, a in [(checker, (1,)), (checker, (2,)), (leaser, (3,)), (rude, (4,)), (reloader, ()), (chaos, ())] if f.__name__ not in os.environ.get('SKIP', '').split(',')]
st = threading.Thread(target=sampler); st.start()
for t in ths: t.start()
envoy = None
if os.environ.get('SOAK_ENVOY_LOAD') and 'envoy' not in os.environ.get('SKIP', '').split(','):
    envoy = subprocess.Popen([os.environ['SOAK_ENVOY_LOAD'], '127.0.0.1:%d' % eport, str(DUR)])
time.sleep(DUR); stop.set()
for t in ths: t.join()
if envoy: envoy.wait()
print('load stopped; errors', errs['n'], flush=True)
st.join()
end = sample(); print('END', end, flush=True)
print('BASE', base_s)
fails = []
if any(x.get('nottl') not in ('0', '') for x in samples + [end]):
    fails.append('Redis keys without a TTL: ' + str([x.get('nottl') for x in samples]))
if end['gor'] > base_s['gor'] + 2:
    fails.append('goroutines %d, baseline %d' % (end['gor'], base_s['gor']))
for k in end:
    if k.startswith('inflight') or k in ('connections', 'hybrid_sync_backlog') or k.startswith('banned_keys'):
        if end[k] != 0: fails.append('%s = %g after the idle time' % (k, end[k]))
g = get('http://127.0.0.1:%d/debug/pprof/goroutine?debug=1' % pport)
open(D + '/goroutines-end.txt', 'w').write(g)
open(D + '/metrics-end.txt', 'w').write(get('http://127.0.0.1:%d/metrics' % aport))
if os.environ.get('HOLD'):
    print('HOLD pid', dm.pid, 'admin', aport, 'pprof', pport, 'redis', ports, flush=True); time.sleep(int(os.environ['HOLD']))
dm.send_signal(signal.SIGTERM); dm.wait(timeout=30)
for n in nodes.values():
    n.terminate(); n.wait()
print('soak: ' + ('FAIL: ' + '; '.join(fails) if fails else 'ok') + ' (files in %s)' % D)
sys.exit(1 if fails else 0)
