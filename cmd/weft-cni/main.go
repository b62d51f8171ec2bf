// Command weft-cni is weft's CNI plugin (conflist "type": "weft-cni"). It is
// run by the container runtime, not by hand; the logic lives in package cni.
package main

import (
	"runtime"

	"github.com/weft-net/weft/cni"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

func init() {
	// Namespace switches apply to one OS thread: keep main on the one it started on.
	runtime.LockOSThread()
}

func main() { cni.Main(version) }
