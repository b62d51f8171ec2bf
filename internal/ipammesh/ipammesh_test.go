package ipammesh

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/mesh/meshtest"
)

// recorder is a gossiper that keeps the rings it got, by how.
type recorder struct {
	mu    sync.Mutex
	rings map[string][]*ipalloc.Ring // "broadcast", "unicast"
}

func (r *recorder) keep(how string, data []byte) {
	m, err := ipalloc.DecodeMsg(data)
	if err != nil {
		return
	}
	if rm, ok := m.(*ipalloc.RingMsg); ok {
		r.mu.Lock()
		r.rings[how] = append(r.rings[how], rm.Ring)
		r.mu.Unlock()
	}
}

func (r *recorder) OnBroadcast(_ mesh.PeerName, data []byte) ([]byte, error) {
	r.keep("broadcast", data)
	return nil, nil
}

func (r *recorder) OnUnicast(_ mesh.PeerName, data []byte) error {
	r.keep("unicast", data)
	return nil
}

func (r *recorder) LocalState() []byte            { return nil }
func (r *recorder) MergeRemoteState([]byte) error { return nil }

// got reports whether r got a ring by how whose entry count is n.
func (r *recorder) got(how string, n int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ring := range r.rings[how] {
		if len(ring.Entries) == n {
			return true
		}
	}
	return false
}

// gotFree reports whether r got a ring by how of n entries whose first
// entry's free count is free.
func (r *recorder) gotFree(how string, n int, free uint32) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ring := range r.rings[how] {
		if len(ring.Entries) == n && ring.Entries[0].Free == free {
			return true
		}
	}
	return false
}

// testRing is a ring of n entries over 10.32.0.0/12, owned in turn by
// owners, with free counts free: n large enough makes it too large for a
// broadcast.
func testRing(t *testing.T, n int, owners []ipalloc.PeerName, free uint32) *ipalloc.Ring {
	t.Helper()
	u := ipalloc.RangeOf(netip.MustParsePrefix("10.32.0.0/12"))
	r := ipalloc.NewRing(u)
	r.Seed = 1
	step := (u.End - u.Start) / ipalloc.Address(n)
	for i := range n {
		r.Entries = append(r.Entries, ipalloc.Entry{Token: u.Start + ipalloc.Address(i)*step, Peer: owners[i%len(owners)], Version: 1, Free: free})
	}
	return r
}

// TestSpreadRings: the rules of Transport.Broadcast, on real meshes: a
// change of this peer's own ranges reaches every other peer by unicast,
// whatever the ring's size; over the broadcast limit, the first ring, a
// newcomer's first ranges and a change of free counts only are left to
// push-pull; a ring that fits is broadcast, and only broadcast when its
// free counts alone changed.
func TestSpreadRings(t *testing.T) {
	const peers = 4
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	net := meshtest.NewNetwork()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	var meshes []*mesh.Mesh
	var recs []*recorder
	var chans []*mesh.Channel
	for i := range peers {
		tr, err := net.NewTransport(fmt.Sprintf("10.0.0.%d:6783", i+1))
		if err != nil {
			t.Fatal(err)
		}
		var join []string
		if i > 0 {
			join = []string{"10.0.0.1:6783"}
		}
		m, err := mesh.New(mesh.Config{Name: mesh.PeerName(fmt.Sprintf("p%d", i)), Version: "test", Peers: join, Logger: log, Transport: tr,
			Timings: mesh.Timings{PushPullInterval: 10 * time.Hour}})
		if err != nil {
			t.Fatal(err)
		}
		rec := &recorder{rings: map[string][]*ipalloc.Ring{}}
		ch, err := m.Channel(Channel, rec)
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Start(ctx); err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		meshes, recs, chans = append(meshes, m), append(recs, rec), append(chans, ch)
	}
	for _, m := range meshes {
		for {
			alive := 0
			for _, p := range m.Peers() {
				if p.State == mesh.StateAlive {
					alive++
				}
			}
			if alive == peers {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("%s never saw all %d peers alive", m.Name(), peers)
			}
			time.Sleep(10 * time.Millisecond) // polling the mesh's view, bounded by ctx
		}
	}
	tr := NewTransport(meshes[0], chans[0])
	defer tr.stop()
	owners := []ipalloc.PeerName{"p0", "p1", "p2", "p3"}
	send := func(r *ipalloc.Ring) {
		t.Helper()
		if err := tr.Broadcast(ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: r})); err != nil {
			t.Fatalf("Broadcast of a ring of %d entries: %v", len(r.Entries), err)
		}
	}
	waitAll := func(how string, n int) {
		t.Helper()
		for _, rec := range recs[1:] {
			for !rec.got(how, n) {
				if ctx.Err() != nil {
					t.Fatalf("a peer never got the ring of %d entries by %s", n, how)
				}
				time.Sleep(10 * time.Millisecond) // polling what the peers got, bounded by ctx
			}
		}
	}
	if big := len(ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: testRing(t, 300, owners, 0)})); big <= mesh.MaxBroadcastSize {
		t.Fatalf("the test ring is %d bytes, not over the broadcast limit %d", big, mesh.MaxBroadcastSize)
	}

	// The first ring over the limit: the others know it (a claim, a
	// restart), left to push-pull.
	send(testRing(t, 300, owners, 0))
	// Free counts only: left to push-pull.
	send(testRing(t, 300, owners, 7))
	if s := tr.Spread(); s.Rings != 0 || s.Deferred != 2 {
		t.Fatalf("after the first ring and a change of free counts: %+v, want none spread and 2 deferred", s)
	}
	// This peer's ranges change (301 entries: the ranges shift): spread to
	// every other peer by unicast.
	send(testRing(t, 301, owners, 7))
	waitAll("unicast", 301)
	// The sender counts a unicast once its stream has returned, which can
	// be after the receiver has the ring: wait for the count too.
	for tr.Spread().Sent < peers-1 && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond) // polling the sender's count, bounded by ctx
	}
	if s := tr.Spread(); s.Rings != 1 || s.Sent < peers-1 {
		t.Fatalf("after a change of this peer's ranges: %+v, want 1 spread by %d unicasts", s, peers-1)
	}
	// A ring that fits goes as a broadcast; one in which this peer's
	// ranges changed (from 301 entries to 5) is unicast to every peer
	// too: a broadcast reaches only some peers (memberlist sends it to
	// about RetransmitMult*log10(N); the ipam channel does not relay).
	send(testRing(t, 5, owners, 7))
	waitAll("broadcast", 5)
	waitAll("unicast", 5)
	if s := tr.Spread(); s.Rings != 2 || s.OverLimit != 3 || s.Deferred != 2 {
		t.Fatalf("after a ring that fits, with this peer's ranges changed: %+v, want 2 spread, 3 over the limit, 2 deferred", s)
	}
	// Free counts only, in a ring that fits: the broadcast alone.
	send(testRing(t, 5, owners, 9))
	for _, rec := range recs[1:] {
		for !rec.gotFree("broadcast", 5, 9) {
			if ctx.Err() != nil {
				t.Fatalf("a peer never got the broadcast of the ring with free counts 9")
			}
			time.Sleep(10 * time.Millisecond) // polling what the peers got, bounded by ctx
		}
		if rec.gotFree("unicast", 5, 9) {
			t.Errorf("a ring whose free counts alone changed was unicast")
		}
	}
	if s := tr.Spread(); s.Rings != 2 || s.Deferred != 2 {
		t.Fatalf("after a change of free counts in a ring that fits: %+v, want still 2 spread, 2 deferred", s)
	}
	for _, rec := range recs[1:] {
		if rec.got("unicast", 300) {
			t.Errorf("a ring left to push-pull was unicast")
		}
	}

	// A newcomer's first ranges (from owning none): its donor spreads the
	// change, so it does not.
	tr2 := NewTransport(meshes[1], chans[1])
	defer tr2.stop()
	others := []ipalloc.PeerName{"p0", "p2", "p3"}
	if err := tr2.Broadcast(ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: testRing(t, 300, others, 0)})); err != nil {
		t.Fatal(err)
	}
	if err := tr2.Broadcast(ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: testRing(t, 302, owners, 0)})); err != nil {
		t.Fatal(err)
	}
	if s := tr2.Spread(); s.Rings != 0 || s.Deferred != 2 {
		t.Errorf("a newcomer's first ranges: %+v, want none spread", s)
	}
}
