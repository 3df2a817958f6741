// Package sync is rlsidecar's Redis layer: the exact global mode (one atomic script per
// check, see Global) and the hybrid mode's periodic flush (see Hybrid), on a standalone
// Redis or a Redis Cluster.
//
// Every key carries a hash tag holding exactly one client's identity (see the rules
// package's key encoding), so one client's counters share a slot and a script can touch
// them atomically. Every key has a TTL, so idle clients vanish. Redis TIME is the only
// clock a script uses: daemons whose clocks disagree still agree on the windows.
//
// Import it as rlsync; the name mirrors the design's layout, not the standard library.
package sync
