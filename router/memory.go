package router

import (
	"os"
	"runtime/debug"
)

// gcPercent is the router's GOGC: a collection when the heap has grown by
// half since the last one, not by all of it (Go's 100). An idle router's
// live heap is 5–8 MiB, so the default lets the heap and what the runtime
// holds from the OS grow by as much again in garbage; at 50 an idle
// router's RSS is about 2 MiB lower (docs/benchmarks.md) for a collection
// about twice as often, a millisecond of CPU each.
const gcPercent = 50

// SetRuntimeDefaults sets the Go runtime's knobs for a router process:
// GOGC as gcPercent unless the environment sets GOGC. Call it once, from
// main, before Build.
func SetRuntimeDefaults() {
	if _, set := os.LookupEnv("GOGC"); !set {
		debug.SetGCPercent(gcPercent)
	}
}

// Memory an idle router would otherwise keep: the runtime returns freed
// pages to the OS only slowly, and an idle router collects rarely (every
// two minutes), so what its start allocated once stays in its RSS. Two
// moments free it, once each.

// freeKDFMemory returns the memory of the password's key derivation
// (Argon2id's 64 MiB, garbage once the keys are made). A no-op without a
// password.
func (r *Router) freeKDFMemory() {
	if r.keys != nil {
		debug.FreeOSMemory()
	}
}

// freeSetupMemory returns what the setup allocated once, when the router
// turns ready: chiefly the CNI plugin binaries (weft-cni and portmap,
// about 16 MiB) read whole to be installed, and the first ring's
// decoding and saving.
func (r *Router) freeSetupMemory() { debug.FreeOSMemory() }
