// Package e2e holds weft's end-to-end tests: clusters of real routers in
// network namespaces on this machine, built with internal/nscluster (the
// code `weft demo` shares with these tests).
//
// The names below are those of nscluster under their old package, so that
// a test written against e2e.X keeps compiling; new code can use
// nscluster.X directly.
package e2e
