package router

import "runtime/debug"

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
