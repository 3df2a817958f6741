package localbucket

import (
	"hash/maphash"
	"unsafe"
)

// A check's keys are found in two dependent cache misses each under many keys (a
// shard's slot, then the record it names: see shard), and a check cannot go on without
// them. A caller that knows the keys of the checks it will decide next (a connection's
// pipelined batch) lets those misses overlap the checks before: Prefetch a few checks
// ahead fetches a key's slot, and PrefetchRecord, once that has arrived, the record it
// names. Neither takes a lock nor waits: they read the shard's view (the slots and
// chunks published whole, so never one array with another's length) and hand the CPU
// addresses to fetch; a slot changed under them gives a wrong address, fetched for
// nothing.

// shardView is what the prefetches read of a shard without its lock: its slots and its
// chunk directory, published whole (shard.view) each time either is replaced. The
// arrays it names are never written through it.
type shardView struct {
	slots  []uint64
	chunks []*[chunkSize]record
}

// publish makes the shard's slots and chunks the ones the prefetches read (under the
// shard's lock, or before the store is shared).
func (sh *shard) publish() { sh.view.Store(&shardView{slots: sh.slots, chunks: sh.chunks}) }

// Prefetching reports whether Prefetch fetches: the store has grown too big for the
// CPU's caches (Options.PrefetchFrom), on a platform where it can.
func (s *Store) Prefetching() bool { return prefetching && s.big.Load() }

// Prefetch starts fetching into the CPU's caches the slot where Apply will look for op's
// key, and leaves the key's hash in op for PrefetchRecord. A hint: it changes nothing
// that Apply decides (which hashes the key again: that is cheap beside a miss, and a
// hash left in op could go stale).
func (s *Store) Prefetch(op *Op) {
	if !prefetching || !s.big.Load() {
		return
	}
	h := maphash.Bytes(s.seed, op.Key)
	op.hash = h
	if v := s.shards[uint32(h)&s.mask].view.Load(); v != nil {
		prefetch(uintptr(unsafe.Pointer(&v.slots[uint32(h>>32)&uint32(len(v.slots)-1)])))
	}
}

// PrefetchRecord starts fetching the record of op's key, found from the slots Prefetch
// fetched: the key's home slot, or one of the next few, in the same cache line as a rule,
// that a probe run put it in (a key further along is not fetched).
func (s *Store) PrefetchRecord(op *Op) {
	if !prefetching || !s.big.Load() {
		return
	}
	h := op.hash
	v := s.shards[uint32(h)&s.mask].view.Load()
	if v == nil {
		return
	}
	hi, mask := uint32(h>>32), uint32(len(v.slots)-1)
	for p, end := hi&mask, hi&mask+recordProbe; p != end; p++ {
		// Read without the shard's lock: a word written whole under it, old or new;
		// either names a record of the shard's chunks, or none.
		x := v.slots[p&mask]
		if x == 0 {
			return // the key is not stored
		}
		if uint32(x>>32) != hi {
			continue
		}
		i := uint32(x) - 1
		if j := int(i >> chunkBits); j < len(v.chunks) {
			r := uintptr(unsafe.Pointer(&v.chunks[j][i&(chunkSize-1)]))
			prefetch2(r, r+unsafe.Sizeof(record{})-1) // a record spans two lines
		}
		return
	}
}

// recordProbe is how many slots from a key's home PrefetchRecord looks for it in.
const recordProbe = 4
