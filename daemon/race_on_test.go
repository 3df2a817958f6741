//go:build race

package daemon

// raceEnabled reports a build with the race detector, under which sync.Pool drops a
// random share of what is put into it: allocation bounds that rely on the pool do not
// hold there (TestPipelineBurstReusesBuffers).
const raceEnabled = true
