package mesh

import (
	"fmt"
	"net/netip"
	"testing"
)

// BenchmarkMergeReports* merge a push-pull's topology state from a cluster
// of n peers, every report news (a newer version each round), into a peer
// that knows them all: what each push-pull and each join costs a peer, and
// why the peers' states are derived once per merge, not once per report.
//
//	go test ./mesh -run '^$' -bench MergeReports
func BenchmarkMergeReports100(b *testing.B)  { mergeReports(b, 100) }
func BenchmarkMergeReports300(b *testing.B)  { mergeReports(b, 300) }
func BenchmarkMergeReports1000(b *testing.B) { mergeReports(b, 1000) }

// mergeReports is one size of BenchmarkMergeReports (not sub-benchmarks:
// the cluster helper's goroutine check would count b.Run's own goroutine).
func mergeReports(b *testing.B, n int) {
	m, names, _ := knowing(b, n)
	reps := make([]report, n)
	version := uint64(0)
	b.ResetTimer()
	for b.Loop() {
		version++
		for i := range reps {
			// each peer finds the next unreachable: suspects to derive
			reps[i] = report{Origin: names[i], Version: version, Unreachable: []PeerName{names[(i+1)%n]}}
		}
		if err := (*topologyGossiper)(m).MergeRemoteState(encodeReports(reps)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPeerEvent* is one memberlist event pair (a peer declared dead,
// then alive again) at a peer that knows n peers, each of which reports
// one other unreachable: what a flap costs a peer. A cluster forming sees
// O(N) such events at every peer.
//
//	go test ./mesh -run '^$' -bench PeerEvent
func BenchmarkPeerEvent100(b *testing.B)  { peerEvent(b, 100) }
func BenchmarkPeerEvent1000(b *testing.B) { peerEvent(b, 1000) }

func peerEvent(b *testing.B, n int) {
	m, names, addrs := knowing(b, n)
	reps := make([]report, n)
	for i := range reps {
		reps[i] = report{Origin: names[i], Version: 1, Unreachable: []PeerName{names[(i+1)%n]}}
	}
	m.applyReports(reps)
	i := 0
	b.ResetTimer()
	for b.Loop() {
		i = (i + 1) % n
		m.onDead(names[i])
		m.onAlive(names[i], addrs[i], nil)
	}
}

// knowing starts a mesh whose view has n more peers alive (memberlist's
// join event for each, not a real peer), closed when b ends.
func knowing(b *testing.B, n int) (*Mesh, []PeerName, []netip.AddrPort) {
	c := newCluster(b)
	p := c.start(1, Config{})
	b.Cleanup(func() { closeAll(b, p) })
	names := make([]PeerName, n)
	addrs := make([]netip.AddrPort, n)
	for i := range n {
		names[i] = PeerName(fmt.Sprintf("peer%04d", i))
		addrs[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 6783)
		p.m.onAlive(names[i], addrs[i], nil)
	}
	return p.m, names, addrs
}
