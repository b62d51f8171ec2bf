package ipalloc

import (
	"flag"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"
)

var seedFlag = flag.Uint64("ipalloc.seed", 0, "seed for the randomised tests; 0 picks one from the clock (each test logs the seed it used)")

// newRand returns a seeded generator and logs the seed, so that a failure can
// be replayed with -ipalloc.seed.
func newRand(t testing.TB) *rand.Rand {
	t.Helper()
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (replay with -ipalloc.seed=%d)", seed, seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// addr parses a dotted IPv4 address, failing the test on bad input.
func addr(t testing.TB, s string) Address {
	t.Helper()
	a, err := AddressFrom(netip.MustParseAddr(s))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// rangeOf is RangeOf for a CIDR literal.
func rangeOf(s string) Range { return RangeOf(netip.MustParsePrefix(s)) }
