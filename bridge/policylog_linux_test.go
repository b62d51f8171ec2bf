package bridge

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	corev1 "k8s.io/api/core/v1"

	"github.com/weft-net/weft/policy"
)

// TestPolicyLogSamples (root): the packets the policy chains drop reach
// the reader of nflog group PolicyLogGroup in the node's namespace, with
// their direction, protocol, addresses and ports; a second reader in the
// same namespace is refused with a reason; after Close, Read ends.
func TestPolicyLogSamples(t *testing.T) {
	p := newPolEnv(t)
	l, err := OpenPolicyLog(p.ns.Path())
	if err != nil {
		t.Fatalf("OpenPolicyLog: %v", err)
	}
	defer l.Close()
	if l2, err := OpenPolicyLog(p.ns.Path()); err == nil {
		l2.Close()
		t.Errorf("a second reader of the group in one namespace was accepted")
	} else if !strings.Contains(err.Error(), "another process reads it") {
		t.Errorf("a second reader: %v; want it to say another process reads the group", err)
	}
	samples := make(chan BlockedPacket, 1024)
	readErr := make(chan error, 1)
	go func() {
		for {
			bs, err := l.Read()
			if err != nil {
				readErr <- err
				return
			}
			for _, b := range bs {
				samples <- b
			}
		}
	}()

	p.sync(t, rulesOf(
		&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true}},
		&policy.PodRules{IP: podC, Egress: policy.Direction{Isolated: true}}))
	if p.try(t, podA, podB, corev1.ProtocolTCP, 80) {
		t.Fatalf("TCP A -> B:80 passed; B is isolated")
	}
	if p.try(t, podC, podD, corev1.ProtocolUDP, 53) {
		t.Fatalf("UDP C -> D:53 passed; C's egress is isolated")
	}
	want := map[string]bool{"ingress TCP " + podA.String() + " -> " + podB.String() + ":80": false,
		"egress UDP " + podC.String() + " -> " + podD.String() + ":53": false}
	deadline := time.After(20 * time.Second)
	for missing := len(want); missing > 0; {
		select {
		case b := <-samples:
			if b.SrcPort == 0 {
				t.Errorf("sample %s has no source port", b)
			}
			// The source port is the sender's: leave it out.
			k := b.Direction() + " " + strings.Replace(b.String(), netip.AddrPortFrom(b.Src, b.SrcPort).String(), b.Src.String(), 1)
			seen, ok := want[k]
			if !ok {
				t.Errorf("unexpected sample %q", k)
				continue
			}
			if !seen {
				want[k] = true
				missing--
			}
		case err := <-readErr:
			t.Fatalf("Read: %v", err)
		case <-deadline:
			t.Fatalf("within 20 s the samples %v (true: seen) did not all arrive", want)
		}
	}
	l.Close()
	select {
	case err := <-readErr:
		if err != ErrPolicyLogClosed {
			t.Errorf("Read after Close: %v; want ErrPolicyLogClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("Read did not return within 10 s of Close")
	}
	if n := l.Lost(); n != 0 {
		t.Errorf("lost %d samples", n)
	}
}

// TestPolicyLogFloodBounded (root, attacker): a pod floods blocked
// packets; the samples that reach the router stay within the kernel's
// limit (PolicyLogBurst, then PolicyLogRate a second), whatever the
// flood's size, and every dropped packet is still counted.
func TestPolicyLogFloodBounded(t *testing.T) {
	p := newPolEnv(t)
	l, err := OpenPolicyLog(p.ns.Path())
	if err != nil {
		t.Fatalf("OpenPolicyLog: %v", err)
	}
	defer l.Close()
	var got atomic.Int64
	go func() {
		for {
			bs, err := l.Read()
			if err != nil {
				return
			}
			got.Add(int64(len(bs)))
		}
	}()
	p.sync(t, rulesOf(&policy.PodRules{IP: podC, Egress: policy.Direction{Isolated: true}}))
	before := p.blocked(t)
	const flood = 3000
	start := time.Now()
	if err := p.pods[podC].Do(func(ns.NetNS) error {
		c, err := net.Dial("udp4", netip.AddrPortFrom(podD, 53).String())
		if err != nil {
			return err
		}
		defer c.Close()
		for range flood {
			if _, err := c.Write([]byte("flood")); err != nil && !errors.Is(err, syscall.EPERM) {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for p.blocked(t)-before < flood && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := p.blocked(t) - before; n < flood {
		t.Fatalf("the counters saw %d of %d dropped packets", n, flood)
	}
	// The kernel flushes its queue within a second: read until nothing
	// more has come for 1.5 s.
	for last, since := got.Load(), time.Now(); time.Since(since) < 1500*time.Millisecond && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if n := got.Load(); n != last || n == 0 {
			last, since = n, time.Now()
		}
	}
	elapsed := time.Since(start).Seconds()
	limit := int64(PolicyLogBurst + PolicyLogRate*(elapsed+1))
	if n := got.Load(); n == 0 || n > limit {
		t.Fatalf("a flood of %d blocked packets gave %d samples in %.1f s; want 1 to %d (burst %d, %d/s)", flood, n, elapsed, limit, PolicyLogBurst, PolicyLogRate)
	}
	t.Logf("a flood of %d blocked packets: %d samples in %.1f s", flood, got.Load(), elapsed)
}
