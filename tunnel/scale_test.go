package tunnel

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel/conn/bindtest"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun/tuntest"
)

// The data plane of one node at N peers (issue 16): what a mesh event and
// a ring change cost, the routes and kernel entries it keeps, and the
// memory per peer. scale_linux_test.go runs the same on a real kernel
// VXLAN device; this file holds the ring they share and the userspace
// figures, on the fakes.

// scaleRing is a ring of self and n peers, as donations leave one: the
// pod range 10.32.0.0/12 halved, a random largest piece at a time, until
// there are k pieces per owner, dealt out at random so that every owner
// has k. Every piece is a CIDR block, so that one range is one route
// (two of an owner's that are neighbours are one range, and two routes
// where they do not make a CIDR block). peers[i] is named "p<i>".
func scaleRing(self string, n, k int, seed uint64) ([]OwnedRange, []string) {
	rnd := rand.New(rand.NewPCG(seed, 0))
	pieces := []netip.Prefix{netip.MustParsePrefix("10.32.0.0/12")}
	for len(pieces) < (n+1)*k {
		// Split one of the largest pieces (smallest Bits).
		minBits := 32
		for _, p := range pieces {
			minBits = min(minBits, p.Bits())
		}
		var largest []int
		for i, p := range pieces {
			if p.Bits() == minBits {
				largest = append(largest, i)
			}
		}
		i := largest[rnd.IntN(len(largest))]
		p := pieces[i]
		lo := netip.PrefixFrom(p.Addr(), p.Bits()+1)
		hi := netip.PrefixFrom(addrOf(u32(p.Addr())|1<<(31-p.Bits())), p.Bits()+1)
		pieces[i] = lo
		pieces = append(pieces, hi)
	}
	owners := []string{self}
	for i := range n {
		owners = append(owners, fmt.Sprintf("p%d", i))
	}
	deal := make([]string, 0, len(pieces))
	for _, o := range owners {
		for range k {
			deal = append(deal, o)
		}
	}
	rnd.Shuffle(len(deal), func(i, j int) { deal[i], deal[j] = deal[j], deal[i] })
	slices.SortFunc(pieces, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	ring := make([]OwnedRange, len(pieces))
	for i, p := range pieces {
		ring[i] = OwnedRange{First: p.Addr(), Last: lastOf(p), Peer: deal[i]}
	}
	return ring, owners[1:]
}

// scaleUnderlay is peer i's underlay address: 198.18.0.0/15 (RFC 2544,
// benchmarking), never routed anywhere; the routes via it are onlink.
func scaleUnderlay(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{198, 18 + byte(i/62500), byte(i / 250 % 250), byte(i%250 + 1)})
}

// donate moves the piece at i of ring to the owner of the piece after it
// (or before, at the end), as a donation does: one range changes owner.
func donate(ring []OwnedRange, i int) []OwnedRange {
	out := slices.Clone(ring)
	j := i + 1
	if j == len(out) {
		j = i - 1
	}
	out[i].Peer = out[j].Peer
	return out
}

// heapInUse is the live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// measure times f.
func measure(f func()) time.Duration {
	t0 := time.Now()
	f()
	return time.Since(t0)
}

// scaleEvents are the mesh events of the benchmarks, by name: what the
// event's SetPeers gets, given the peers and the peers less the last.
var scaleEvents = []struct {
	name string
	doc  string
}{
	{"unchanged", "a peer's metadata gossiped again: the same peers"},
	{"leave-rejoin", "the last peer leaves, then comes back: two SetPeers per two ops"},
}

// scalePeersFor is the i-th event's peers.
func scalePeersFor(event string, i int, all []Peer) []Peer {
	if event == "leave-rejoin" && i%2 == 0 {
		return all[:len(all)-1]
	}
	return all
}

// BenchmarkSealedPeers: a node with a password and n peers outside the
// trusted subnets (a session each), on the fakes. Reported: the first
// SetPeers (a router that starts into a cluster of n: n key agreements),
// the heap per peer that the Device keeps (its session, path, snapshot
// entry, and the ring's routes), and the cost of one mesh event with n
// peers (ns/op, one SetPeers): one that changes nothing (the most
// frequent: a peer's metadata gossiped again), and a peer that leaves and
// comes back (its session parked, then found again).
func BenchmarkSealedPeers(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		for _, ev := range scaleEvents {
			b.Run(fmt.Sprintf("peers=%d/event=%s", n, ev.name), func(b *testing.B) {
				ka, err := crypt.GenerateKeyPair()
				if err != nil {
					b.Fatal(err)
				}
				peers := make([]Peer, n)
				for i := range peers {
					kp, err := crypt.GenerateKeyPair()
					if err != nil {
						b.Fatal(err)
					}
					pub := kp.Public()
					peers[i] = Peer{Name: fmt.Sprintf("p%d", i), Underlay: scaleUnderlay(i), DataPort: DefaultDataPort, PublicKey: pub[:]}
				}
				ring, _ := scaleRing("a", n, 3, 1)
				before := heapInUse()
				d, err := New(Config{Self: "a", Mode: ModeAuto, MTU: 1440, Underlay: netip.MustParseAddr("192.0.2.1"),
					TUN: tuntest.New("weft-tun", 1440), UDP: bindtest.NewNetwork().Bind(netip.MustParseAddrPort("192.0.2.1:6784")),
					PSK: pskOne, KeyPair: ka, Logger: slog.New(slog.DiscardHandler)})
				if err != nil {
					b.Fatal(err)
				}
				defer d.Close()
				fill := measure(func() {
					if err := d.SetPeers(peers); err != nil {
						b.Fatal(err)
					}
				})
				if err := d.SetRing(ring, netip.MustParseAddr("10.32.0.1")); err != nil {
					b.Fatal(err)
				}
				perPeer := float64(heapInUse()-before) / float64(n)
				sealed := 0
				for _, c := range d.Connections() {
					if c.Mode == ModeUDP && c.Encrypted {
						sealed++
					}
				}
				if sealed != n {
					b.Fatalf("%d of %d peers have a sealed udp path: %+v", sealed, n, d.Connections())
				}
				i := 0
				for b.Loop() {
					if err := d.SetPeers(scalePeersFor(ev.name, i, peers)); err != nil {
						b.Fatal(err)
					}
					i++
				}
				b.ReportMetric(fill.Seconds()*1e3, "first-SetPeers-ms")
				b.ReportMetric(perPeer, "heap-B/peer")
			})
		}
	}
}

// BenchmarkTableOwner: the lookup of a packet's owner (every packet into
// the TUN device) in a ring of n peers with 3 ranges each.
func BenchmarkTableOwner(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			ring, _ := scaleRing("a", n, 3, 1)
			t, err := NewTable(ring)
			if err != nil {
				b.Fatal(err)
			}
			rnd := rand.New(rand.NewPCG(2, 0))
			dsts := make([]netip.Addr, 4096)
			for i := range dsts {
				dsts[i] = addrOf(u32(netip.MustParseAddr("10.32.0.0")) + rnd.Uint32N(1<<20))
			}
			i := 0
			for b.Loop() {
				if _, ok := t.Owner(dsts[i%len(dsts)]); !ok {
					b.Fatalf("no owner of %s", dsts[i%len(dsts)])
				}
				i++
			}
		})
	}
}
