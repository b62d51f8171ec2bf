//go:build !linux

// Command podbench measures pod-to-pod throughput through weft routers; it
// needs Linux.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "podbench: needs Linux (network namespaces, weft routers)")
	os.Exit(2)
}
