//go:build !linux

// Command tunnelbench measures weft's data plane; it needs Linux.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "tunnelbench: needs Linux (network namespaces, TUN devices)")
	os.Exit(2)
}
