package mesh

import (
	"context"
	"fmt"
	"testing"
)

// Three peers over the real UDP/TCP transport on loopback, ephemeral ports.
func TestRealTransportLoopback(t *testing.T) {
	var ps []*peer
	for i := 1; i <= 3; i++ {
		log, lb := newLogger(t, fmt.Sprintf("node%d", i))
		cfg := Config{
			Name: PeerName(fmt.Sprintf("node%d", i)), Nickname: fmt.Sprintf("host%d", i),
			BindAddr: "127.0.0.1", Port: 0, Components: []Component{testTunnel(6784, "udp")}, Logger: log, Timings: testTimings(),
		}
		if i > 1 {
			cfg.Peers = []string{ps[0].m.Addr().String()}
		}
		m, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		p := &peer{m: m, set: newSetGossiper(), log: lb}
		if p.ch, err = m.Channel("set", p.set); err != nil {
			t.Fatal(err)
		}
		if m.Addr().Port() == 0 || m.Addr().Addr().String() != "127.0.0.1" {
			t.Fatalf("advertised address %s, want 127.0.0.1 and the bound port", m.Addr())
		}
		if err := m.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	defer closeAll(t, ps...)
	waitStates(t, converge, ps, aliveAll(ps))

	if err := ps[2].ch.Broadcast([]byte("set:udp")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "the broadcast to reach every peer", func() bool {
		for _, p := range ps {
			if !p.set.has("udp") {
				return false
			}
		}
		return true
	})
	if err := ps[0].ch.SendTo("node2", []byte("tcp")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "the unicast", func() bool { return len(ps[1].set.received()) == 1 })

	// A graceful leave over the real transport.
	if err := ps[2].m.Close(); err != nil {
		t.Fatal(err)
	}
	waitStates(t, converge, ps[:2], map[PeerName]PeerState{"node3": StateLeft})
}
