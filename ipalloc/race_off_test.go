//go:build !race

package ipalloc

const raceEnabled = false
