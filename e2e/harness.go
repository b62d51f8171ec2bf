package e2e

import "github.com/weft-net/weft/internal/nscluster"

// The harness's portable part, under the names the tests use.
type Matrix = nscluster.Matrix

var (
	FindBinDir = nscluster.FindBinDir
	NewMatrix  = nscluster.NewMatrix
)
