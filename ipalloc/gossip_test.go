package ipalloc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// gossipEnv is a lone service owning 10.32.0.0/24 with a pod, and its
// gossip adapter on a clock the test moves.
func gossipEnv(t testing.TB) (*svcEnv, *Gossip, *time.Time) {
	e := newSvcEnv(t, "10.32.0.0/24")
	e.mustStart()
	if _, _, err := e.svc.Allocate(context.Background(), Key{ContainerID: "pod1", IfName: "eth0"}, Meta{}); err != nil {
		t.Fatal(err)
	}
	now := testNow
	return e, NewGossip(e.svc, e.logger(), func() time.Time { return now }), &now
}

// frameV0 is the push-pull frame of weft up to 8aaa770.
func frameV0(from PeerName, msg []byte) []byte {
	b := binary.AppendUvarint(nil, uint64(len(from)))
	return append(append(b, from...), msg...)
}

func TestGossipStateFrame(t *testing.T) {
	e, g, now := gossipEnv(t)
	own := g.LocalState()
	if own[0] != stateFrameTag || own[1] != stateFrameVersion {
		t.Fatalf("LocalState frame starts %x, want ff 01", own[:2])
	}
	from, msg, err := DecodeStateFrame(own)
	if err != nil || from != "self" || string(msg) != string(e.svc.LocalState()) {
		t.Fatalf("DecodeStateFrame(LocalState) = %q, %x, %v", from, msg, err)
	}
	// A frame of main's format (a peer not yet upgraded) is read.
	from, msg, err = DecodeStateFrame(frameV0("peer2", e.svc.LocalState()))
	if err != nil || from != "peer2" || string(msg) != string(e.svc.LocalState()) {
		t.Fatalf("v0 frame: %q, %x, %v", from, msg, err)
	}
	if err := g.MergeRemoteState(frameV0("peer2", e.svc.LocalState())); err != nil {
		t.Fatalf("MergeRemoteState of a v0 frame: %v", err)
	}
	// A newer version is refused, counted, and logged once per minute.
	newer := append([]byte{stateFrameTag, 2}, own[2:]...)
	for range 3 {
		err := g.MergeRemoteState(newer)
		var unknown *UnknownFrameError
		if !errors.As(err, &unknown) || unknown.Version != 2 || !errors.Is(err, ErrBadMessage) {
			t.Fatalf("a v2 frame: %v, want an UnknownFrameError", err)
		}
	}
	if g.Refused() != 3 {
		t.Errorf("Refused() = %d, want 3", g.Refused())
	}
	if n := strings.Count(e.log.String(), "refused gossip of another weft version"); n != 1 {
		t.Errorf("logged %d times in a minute, want once:\n%s", n, e.log.String())
	}
	*now = now.Add(GossipLogEvery)
	_ = g.MergeRemoteState(newer)
	if n := strings.Count(e.log.String(), "refused-since-last-log=2"); n != 1 {
		t.Errorf("after a minute: the second log does not count the 2 suppressed:\n%s", e.log.String())
	}
	// A broadcast of another message format is refused and counted too.
	if err := g.OnBroadcast("peer2", []byte{9, byte(kindRing)}); !errors.Is(err, ErrBadMessage) {
		t.Errorf("a broadcast of format 9: %v", err)
	}
	if g.Refused() != 5 {
		t.Errorf("Refused() = %d, want 5", g.Refused())
	}
	for _, bad := range [][]byte{{}, {stateFrameTag}, {0}, {65}, {5, 'p'}, {stateFrameTag, 1, 3, 'a', ' ', 'b'}} {
		if _, _, err := DecodeStateFrame(bad); !errors.Is(err, ErrBadMessage) {
			t.Errorf("DecodeStateFrame(%x) = %v, want ErrBadMessage", bad, err)
		}
	}
}

// FuzzIPAMStateFrame feeds arbitrary push-pull states (the frame and the
// allocator's state in it, as a peer or anyone who reaches the gossip port
// without a password sends them) to MergeRemoteState: it must never panic,
// and whatever it accepts, every address this peer holds stays in a range
// its own ring gives it. (It was in package router, before the adapter
// moved here.)
func FuzzIPAMStateFrame(f *testing.F) {
	e, g, _ := gossipEnv(f)
	own := g.LocalState()
	f.Add(own)
	f.Add(frameV0("peer2", e.svc.LocalState()))
	f.Add(AppendStateFrame(nil, "peer2", e.svc.LocalState()))
	f.Add([]byte{})
	f.Add([]byte{0x05, 'p', 'e', 'e', 'r'})
	f.Add([]byte{stateFrameTag, 7, 0x05, 'p', 'e', 'e', 'r'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})

	f.Fuzz(func(t *testing.T, data []byte) {
		_ = g.MergeRemoteState(data)
		snap := e.svc.Snapshot()
		if len(snap.Allocations) == 0 {
			t.Fatalf("after %x: the pod's address is gone", data)
		}
		for _, a := range snap.Allocations {
			if owner, ok := snap.Ring.Owner(a.Address); !ok || owner != snap.Self {
				t.Fatalf("after %x: %v holds %s, which its ring gives to %q", data, a.Key, a.Address, owner)
			}
		}
	})
}

// forgedState is a push-pull state from "evil" carrying e's saved ring
// with the entry that holds addr changed by f.
func forgedState(t testing.TB, e *svcEnv, addr Address, f func(*Entry)) []byte {
	t.Helper()
	r := e.svc.Snapshot().Ring.Clone()
	i := r.index(addr)
	if r.Entries[i].Peer != "self" {
		t.Fatalf("setup: %s is in %+v", addr, r.Entries[i])
	}
	f(&r.Entries[i])
	return AppendStateFrame(nil, "evil", EncodeMsg(&RingMsg{Ring: r}))
}

// TestForgedRingKeepsAllocations: a push-pull state that anyone who
// reaches the gossip port without a password can send, showing this peer's
// own entries changed as only its lost self could have (the signs of a
// stale state), makes it drop no address its pods use and give none of
// their ranges away; and unless the ring takes its ranges (as its
// reclaimer's does), it goes on allocating. (FuzzIPAMStateFrame found
// the first: a lone peer took such a ring for a sign of a restored backup,
// dropped its allocation, and then took the ring that gave its range to
// "evil".)
func TestForgedRingKeepsAllocations(t *testing.T) {
	for name, f := range map[string]func(*Entry){
		"given to another at a donation's version": func(e *Entry) { e.Version += 2; e.Peer = "evil" },
		"a newer version of its own entry":         func(e *Entry) { e.Version++; e.Free-- },
		"the same version, another free count":     func(e *Entry) { e.Free-- },
	} {
		takes := strings.HasPrefix(name, "given")
		for _, restarted := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/restarted=%v", name, restarted), func(t *testing.T) {
				e, g, _ := gossipEnv(t)
				pod := Key{ContainerID: "pod1", IfName: "eth0"}
				held := heldAddr(t, e.svc.Snapshot(), pod)
				if held == 0 {
					t.Fatal("setup: no pod")
				}
				if restarted {
					// A pod of the saved state, which the node shows in use.
					e.restart()
					g = NewGossip(e.svc, e.logger(), func() time.Time { return testNow })
					if err := e.svc.HoldFound(map[Key]netip.Addr{pod: held.Addr()}); err != nil {
						t.Fatal(err)
					}
				}
				_ = g.MergeRemoteState(forgedState(t, e, held, f))
				snap := e.svc.Snapshot()
				if a := heldAddr(t, snap, pod); a != held {
					t.Fatalf("after the forged ring: %s holds %s (had %s)\n%s", pod, a, held, e.log.String())
				}
				if o, _ := snap.Ring.Owner(held); o != "self" {
					t.Fatalf("after the forged ring: its ring gives %s to %q", held, o)
				}
				if takes {
					// A ring that takes its ranges is what its reclaimer
					// sends: it allocates no more (removal_test.go).
					// Without a password a liar can pose as one.
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if _, _, err := e.svc.Allocate(ctx, Key{ContainerID: "pod2", IfName: "eth0"}, Meta{}); err != nil {
					t.Fatalf("after the forged ring, an ADD: %v\n%s", err, e.log.String())
				}
			})
		}
	}
}

// heldAddr is the address snap holds for k (0: none).
func heldAddr(t testing.TB, snap Snapshot, k Key) Address {
	for _, al := range snap.Allocations {
		if al.Key == k {
			return al.Address
		}
	}
	return 0
}
