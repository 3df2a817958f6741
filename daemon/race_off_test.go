//go:build !race

package daemon

// raceEnabled: see race_on_test.go.
const raceEnabled = false
