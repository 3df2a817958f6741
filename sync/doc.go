// Package sync is rlsidecar's Redis layer: the exact global mode (one atomic script per
// check, see Global), the hybrid mode's periodic flush (see Hybrid) and the penalty
// rules' shared bans (see Bans), on a standalone Redis or a Redis Cluster.
//
// Every key carries a hash tag holding exactly one client's identity (see the rules
// package's key encoding), so one client's counters share a slot and a script can touch
// them atomically. Every key has a TTL, so idle clients vanish. Redis TIME is the only
// clock a limit's script and the shared bans' scripts use: daemons whose clocks disagree
// still agree on the windows and on who is banned until when (a daemon converts a ban's
// end to its own clock with the offset it measures, see Bans). One exception takes the
// daemon's wall clock, because its bounds are the daemon's to compute: a calendar window
// (its key names the window, from the rule's time zone).
//
// Import it as rlsync; the name mirrors the design's layout, not the standard library.
package sync
