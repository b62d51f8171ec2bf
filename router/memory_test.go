package router

import (
	"os"
	"runtime/debug"
	"testing"
)

// SetRuntimeDefaults sets GOGC to gcPercent, unless the environment sets
// GOGC: the operator's value wins.
func TestSetRuntimeDefaults(t *testing.T) {
	old := debug.SetGCPercent(100)
	defer debug.SetGCPercent(old)
	t.Setenv("GOGC", "") // restored after the test
	os.Unsetenv("GOGC")
	SetRuntimeDefaults()
	if got := debug.SetGCPercent(100); got != gcPercent {
		t.Errorf("GOGC without the environment's: %d, want %d", got, gcPercent)
	}
	t.Setenv("GOGC", "100")
	SetRuntimeDefaults()
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GOGC=100 in the environment: %d, want it kept", got)
	}
}
