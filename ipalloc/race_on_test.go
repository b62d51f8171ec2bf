//go:build race

package ipalloc

// raceEnabled: the race detector slows the single-threaded simulation
// several times over and finds nothing in it; make test runs the many
// schedules without it (see the Makefile).
const raceEnabled = true
