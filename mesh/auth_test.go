package mesh

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Gossip keys as crypt.DeriveKeys would make them from two passwords.
var (
	keyOne = bytes.Repeat([]byte{1}, 32)
	keyTwo = bytes.Repeat([]byte{2}, 32)
)

const authLine = "failed authentication: wrong or missing password (check --password-file on both sides)"

// startLoopback starts a peer over the real UDP/TCP transport on
// 127.0.0.1 with the given gossip key, joining join (if any).
func startLoopback(t *testing.T, name string, key []byte, join *Mesh) *peer {
	t.Helper()
	log, lb := newLogger(t, name)
	cfg := Config{Name: PeerName(name), BindAddr: "127.0.0.1", Components: []Component{testTunnel(6784, "udp")}, Logger: log, Timings: testTimings(), SecretKey: key}
	if join != nil {
		cfg.Peers = []string{join.Addr().String()}
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
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestAuthenticatedMesh: over real UDP and TCP, two peers with the same
// key join and gossip; a third with another key and a fourth with none
// try to join them and never appear in any view. The peers tried count
// the failures and log one clear line per address (the same 127.0.0.1
// for both intruders here), and so do the intruders about their targets.
func TestAuthenticatedMesh(t *testing.T) {
	a := startLoopback(t, "a", keyOne, nil)
	b := startLoopback(t, "b", keyOne, a.m)
	wrong := startLoopback(t, "wrong", keyTwo, a.m)
	none := startLoopback(t, "none", nil, b.m)
	defer closeAll(t, a, b, wrong, none)
	members := []*peer{a, b}
	waitStates(t, converge, members, aliveAll(members))
	if err := a.ch.Broadcast([]byte("set:secret")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "the broadcast to reach b", func() bool { return b.set.has("secret") })
	waitFor(t, converge, "failed joins to be counted", func() bool {
		return counterValue(t, a.m.metrics.authFailures) >= 2 && counterValue(t, b.m.metrics.authFailures) >= 2 &&
			counterValue(t, wrong.m.metrics.authFailures) >= 2 && counterValue(t, none.m.metrics.authFailures) >= 2
	})
	for _, p := range members {
		for _, q := range p.m.Peers() {
			if q.Name == "wrong" || q.Name == "none" {
				t.Errorf("%s's view has %s (%v)", p.m.Name(), q.Name, q.State)
			}
		}
	}
	for _, p := range []*peer{wrong, none} {
		if ps := p.m.Peers(); len(ps) != 1 {
			t.Errorf("%s sees %d peers, want only itself", p.m.Name(), len(ps))
		}
		if got := p.set.has("secret"); got {
			t.Errorf("%s got the gossip", p.m.Name())
		}
	}
	// One line per address a minute, however many attempts.
	for _, p := range members {
		if n := strings.Count(p.log.String(), "peer 127.0.0.1 "+authLine); n != 1 {
			t.Errorf("%s logged the authentication line %d times, want once:\n%s", p.m.Name(), n, p.log.String())
		}
	}
	for _, p := range []*peer{wrong, none} {
		if !p.log.contains(authLine) {
			t.Errorf("%s did not log why it cannot join", p.m.Name())
		}
	}
	if a.log.contains("level=ERROR") {
		t.Errorf("memberlist's raw errors leaked at error level:\n%s", a.log.String())
	}
}

func TestSecretKeyLength(t *testing.T) {
	_, err := New(Config{Name: "a", BindAddr: "127.0.0.1", SecretKey: []byte("short")})
	if err == nil || !strings.Contains(err.Error(), "gossip secret key of 5 bytes") {
		t.Errorf("New with a 5-byte key: %v", err)
	}
}

func TestParseAuthFailure(t *testing.T) {
	for _, tc := range []struct {
		line, addr string
		ok         bool
	}{
		// The lines memberlist v0.7.0 logs (seen in TestAuthenticatedMesh).
		{"failed to receive: no installed keys could decrypt the message from=127.0.0.1:35250", "127.0.0.1", true},
		{"failed to receive: encryption is configured but remote state is not encrypted from=10.0.0.7:57348", "10.0.0.7", true},
		{"failed to receive: remote state is encrypted and encryption is not configured from=[::ffff:10.0.0.7]:54438", "10.0.0.7", true},
		{"Decrypt packet failed: no installed keys could decrypt the message from=10.0.0.7:6783", "10.0.0.7:6783", true},
		{"Decrypt packet failed: unsupported encryption version 3 from=10.0.0.7:6783", "10.0.0.7:6783", true},
		{"failed to join 10.0.0.1:6783: no installed keys could decrypt the message", "10.0.0.1:6783", true},
		{"Push/Pull with node2 failed: encryption is configured but remote state is not encrypted", "node2", true},
		{"Decrypt packet failed: payload is too small to decrypt: 3 from=<unknown address>", "<unknown address>", true},
		// Not about keys.
		{"failed to receive: EOF from=10.0.0.7:5000", "", false},
		{"Stream connection from=10.0.0.7:5000", "", false},
		{"failed to join 10.0.0.1:6783: dial tcp 10.0.0.1:6783: connect: connection refused", "", false},
	} {
		addr, ok := parseAuthFailure(tc.line)
		if addr != tc.addr || ok != tc.ok {
			t.Errorf("%q: %q, %v; want %q, %v", tc.line, addr, ok, tc.addr, tc.ok)
		}
	}
}

// TestAuthFailureRateLimit: one warning per host a minute, with the
// count since the last; every failure counted.
func TestAuthFailureRateLimit(t *testing.T) {
	var buf bytes.Buffer
	var mu sync.Mutex
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	a := &authFailures{log: slog.New(slog.NewTextHandler(&buf, nil)), count: c, now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}
	a.limit.every = time.Minute
	l := memberlistLogger(slog.New(slog.DiscardHandler), a, nil)
	for i := range 5 {
		l.Printf("[ERR] memberlist: Decrypt packet failed: no installed keys could decrypt the message from=10.0.0.7:%d", 6783+i)
	}
	l.Printf("[ERR] memberlist: failed to receive: no installed keys could decrypt the message from=10.0.0.8:40000")
	mu.Lock()
	now = now.Add(61 * time.Second)
	mu.Unlock()
	l.Printf("[ERR] memberlist: Decrypt packet failed: no installed keys could decrypt the message from=10.0.0.7:6783")
	out := buf.String()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	want := []string{
		fmt.Sprintf(`msg="peer 10.0.0.7:6783 %s" peer-address=10.0.0.7:6783 failures=1`, authLine),
		fmt.Sprintf(`msg="peer 10.0.0.8 %s" peer-address=10.0.0.8 failures=1`, authLine),
		fmt.Sprintf(`msg="peer 10.0.0.7:6783 %s" peer-address=10.0.0.7:6783 failures=5`, authLine),
	}
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), out)
	}
	for i, w := range want {
		if !strings.Contains(lines[i], "level=WARN") || !strings.HasSuffix(lines[i], w) {
			t.Errorf("line %d: %s\nwant ...%s", i, lines[i], w)
		}
	}
	if got := counterValue(t, c); got != 7 {
		t.Errorf("counted %v failures, want 7", got)
	}
}
