package bench

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// BenchmarkEvictZipf measures what the local store's key cap (--max-keys) costs in
// accuracy on a public API's key population: the same schedule of checks is decided by a
// store capped at RLSIDECAR_EVICT_CAP keys (default 65,536, over the daemon's 256 shards)
// and by one that holds every key, on a simulated clock (no daemon, no sleeps: the
// figures depend only on the draws and the store's eviction rank), and it reports, per
// client, what the capped store admitted beyond the uncapped one (over: requests past
// the client's limit, let through because its state was evicted and came back fresh) and
// short of it (under: decided on a rule's shared fallback state).
//
// The traffic: RLSIDECAR_EVICT_RATE checks a simulated second (default 2,000) for
// RLSIDECAR_EVICT_SECONDS (default 1,200), a tenth of them from 10 hot clients in turn,
// the rest drawn from Zipf (s = 1.1) over RLSIDECAR_EVICT_KEYS clients (default
// 1,000,000). Each check is two rules of the client's plan (a tenth of the clients, and
// the hot ones, are partners): rate, a token bucket of 60 a minute (partners 600), and
// quota, a fixed window of 1,000 an hour (partners 20,000).
//
// Sub-benchmarks:
//   - zipf: that traffic alone.
//   - flood: that traffic, 10 brute-forcers trying one account each once a second against
//     login (a fixed window of 5 a minute), and a flood of fresh keys, each seen once, at
//     RLSIDECAR_EVICT_FLOOD a second (default 1,000) on bulk (a fixed window of 100,000 a
//     day per key) at cost RLSIDECAR_EVICT_FLOOD_COST (default 10: a bulk call costing ten
//     units). It reports, beside over and under, what the brute-forcers were admitted
//     against the 5 a minute each that they may have.
//
// Runs once: use -benchtime 1x, e.g.
//
//	go test ./bench/ -run '^$' -bench 'BenchmarkEvictZipf' -benchtime 1x -v
func BenchmarkEvictZipf(b *testing.B) {
	keys, _ := strconv.Atoi(spreadEnv("RLSIDECAR_EVICT_KEYS", "1000000"))
	capKeys, _ := strconv.Atoi(spreadEnv("RLSIDECAR_EVICT_CAP", "65536"))
	rate, _ := strconv.ParseFloat(spreadEnv("RLSIDECAR_EVICT_RATE", "2000"), 64)
	secs, _ := strconv.ParseFloat(spreadEnv("RLSIDECAR_EVICT_SECONDS", "1200"), 64)
	flood, _ := strconv.ParseFloat(spreadEnv("RLSIDECAR_EVICT_FLOOD", "1000"), 64)
	floodCost, _ := strconv.ParseUint(spreadEnv("RLSIDECAR_EVICT_FLOOD_COST", "10"), 10, 64)
	if keys < 2 || capKeys < 1 || rate <= 0 || secs <= 0 || flood < 0 || floodCost < 1 {
		b.Fatal("RLSIDECAR_EVICT_KEYS, _CAP, _RATE, _SECONDS, _FLOOD, _FLOOD_COST: want keys ≥ 2, cap ≥ 1, rate and seconds > 0, flood ≥ 0, cost ≥ 1")
	}
	for _, name := range []string{"zipf", "flood"} {
		b.Run(name, func(b *testing.B) {
			fl, bf := 0.0, 0
			if name == "flood" {
				fl, bf = flood, 10
			}
			evictZipf(b, evictLoad{keys: keys, rate: rate, load: time.Duration(secs * float64(time.Second)),
				flood: fl, floodCost: floodCost, bruteForcers: bf}, capKeys)
		})
	}
}

type evictLoad struct {
	keys         int
	rate         float64
	load         time.Duration
	flood        float64 // fresh keys a second on bulk
	floodCost    uint64
	bruteForcers int // clients trying login once a second
}

// evictCheck is one check of the schedule: a client (an index into the names) and the
// rules it goes through.
type evictCheck struct {
	at     time.Duration
	client int32
	kind   uint8 // evictAPI, evictLogin, evictBulk
}

const (
	evictAPI = iota
	evictLogin
	evictBulk
)

func mustEvictLimit(b *testing.B, alg localbucket.Algorithm, n uint64, per time.Duration) *localbucket.Limit {
	l, err := localbucket.NewLimit(alg, n, per, 0)
	if err != nil {
		b.Fatal(err)
	}
	return &l
}

func evictZipf(b *testing.B, ld evictLoad, capKeys int) {
	rateFree := mustEvictLimit(b, localbucket.TokenBucket, 60, time.Minute)
	ratePartner := mustEvictLimit(b, localbucket.TokenBucket, 600, time.Minute)
	quotaFree := mustEvictLimit(b, localbucket.FixedWindow, 1000, time.Hour)
	quotaPartner := mustEvictLimit(b, localbucket.FixedWindow, 20000, time.Hour)
	login := mustEvictLimit(b, localbucket.FixedWindow, 5, time.Minute)
	bulk := mustEvictLimit(b, localbucket.FixedWindow, 100000, 24*time.Hour)

	// The schedule: Poisson arrivals of the API's checks, the brute-forcers' tries once a
	// second each, the flood's fresh keys evenly spaced.
	const hot = 10
	rng := rand.New(rand.NewPCG(11, 12))
	z := rand.NewZipf(rng, 1.1, 1, uint64(ld.keys-1))
	var names []string
	ids := map[string]int32{}
	id := func(s string) int32 {
		if i, ok := ids[s]; ok {
			return i
		}
		ids[s] = int32(len(names))
		names = append(names, s)
		return int32(len(names) - 1)
	}
	var evs []evictCheck
	for at, i := time.Duration(0), 0; ; i++ {
		at += time.Duration(rng.ExpFloat64() / ld.rate * float64(time.Second))
		if at >= ld.load {
			break
		}
		c := "z" + strconv.FormatUint(z.Uint64(), 10)
		if i%10 == 0 {
			c = "hot" + strconv.Itoa(i/10%hot)
		}
		evs = append(evs, evictCheck{at, id(c), evictAPI})
	}
	for k := range ld.bruteForcers {
		c := id("brute" + strconv.Itoa(k))
		for at := time.Duration(k) * time.Second / time.Duration(ld.bruteForcers); at < ld.load; at += time.Second {
			evs = append(evs, evictCheck{at, c, evictLogin})
		}
	}
	if ld.flood > 0 {
		step := time.Duration(float64(time.Second) / ld.flood)
		n := 0
		for at := step / 2; at < ld.load; at += step {
			evs = append(evs, evictCheck{at, id("f" + strconv.Itoa(n)), evictBulk})
			n++
		}
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	partner := make([]bool, len(names))
	for i, n := range names {
		h := fnv.New32a()
		h.Write([]byte(n))
		partner[i] = strings.HasPrefix(n, "hot") || h.Sum32()%10 == 0
	}

	// base is the start of a UTC day, so that every fixed window starts with the load.
	base := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC).UnixNano()
	run := func(maxKeys int) (admitted []int32, st *localbucket.Store) {
		st = localbucket.NewStore(localbucket.Options{MaxKeys: maxKeys})
		admitted = make([]int32, len(names))
		ops := make([]localbucket.Op, 2)
		k0, k1 := make([]byte, 0, 64), make([]byte, 0, 64)
		for _, e := range evs {
			n := names[e.client]
			var batch []localbucket.Op
			switch e.kind {
			case evictAPI:
				k0 = append(append(append(k0[:0], "rate:{"...), n...), '}')
				k1 = append(append(append(k1[:0], "quota:{"...), n...), '}')
				r, q := rateFree, quotaFree
				if partner[e.client] {
					r, q = ratePartner, quotaPartner
				}
				ops[0] = localbucket.Op{Key: k0, Limit: r, Cost: 1}
				ops[1] = localbucket.Op{Key: k1, Limit: q, Cost: 1}
				batch = ops[:2]
			case evictLogin:
				k0 = append(append(append(k0[:0], "login:{"...), n...), '}')
				ops[0] = localbucket.Op{Key: k0, Limit: login, Cost: 1}
				batch = ops[:1]
			case evictBulk:
				k0 = append(append(append(k0[:0], "bulk:{"...), n...), '}')
				ops[0] = localbucket.Op{Key: k0, Limit: bulk, Cost: ld.floodCost}
				batch = ops[:1]
			}
			if st.Apply(base+int64(e.at), batch) {
				admitted[e.client]++
			}
		}
		return admitted, st
	}
	b.ResetTimer()
	free, freeStore := run(1 << 30)
	capped, cappedStore := run(capKeys)
	b.StopTimer()

	var over, under, overHot, overBrute, brute, offered int
	type diff struct {
		client       string
		capped, free int32
	}
	var worst []diff
	for i := range names {
		d := int(capped[i] - free[i])
		if strings.HasPrefix(names[i], "f") {
			continue // the flood's keys: each seen once, admitted either way
		}
		if d > 0 {
			over += d
			worst = append(worst, diff{names[i], capped[i], free[i]})
		} else {
			under -= d
		}
		if strings.HasPrefix(names[i], "hot") && d > 0 {
			overHot += d
		}
		if strings.HasPrefix(names[i], "brute") {
			brute += int(capped[i])
			overBrute += d
		}
	}
	for _, e := range evs {
		if e.kind == evictAPI {
			offered++
		}
	}
	sort.Slice(worst, func(i, j int) bool { return worst[i].capped-worst[i].free > worst[j].capped-worst[j].free })
	var ws []string
	for _, w := range worst[:min(5, len(worst))] {
		ws = append(ws, fmt.Sprintf("%s %d/%d", w.client, w.capped, w.free))
	}
	b.ReportMetric(float64(over), "over")
	b.ReportMetric(float64(under), "under")
	b.ReportMetric(float64(over)/float64(offered), "over/check")
	if ld.bruteForcers > 0 {
		b.ReportMetric(float64(brute)/float64(ld.bruteForcers), "brute-admitted/client")
	}
	b.Logf("%d API checks at %.0f/s for %v (Zipf over %d, 10 hot at 10%%), %d brute-forcers at 1/s on 5/min, flood %.0f/s fresh keys at cost %d on 100,000/day; "+
		"keys held uncapped %d, cap %d (capped store: %d held, %d evictions, %d untracked decisions): "+
		"capped beyond uncapped: over %d (hot %d, brute-forcers %d), under %d; brute-forcers admitted %d (may: %d); largest over, capped/uncapped: %s",
		offered, ld.rate, ld.load, ld.keys, ld.bruteForcers, ld.flood, ld.floodCost,
		freeStore.Len(), capKeys, cappedStore.Len(), cappedStore.Evictions(), cappedStore.Untracked(),
		over, overHot, overBrute, under, brute, ld.bruteForcers*5*int((ld.load+time.Minute-1)/time.Minute), strings.Join(ws, ", "))
}
