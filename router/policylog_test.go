package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/internal/syncbuf"
)

// samplingEnforcer is a fakeEnforcer whose drops are samples the test
// sends.
type samplingEnforcer struct {
	*fakeEnforcer
	samples chan []bridge.BlockedPacket
	// openErr is OpenSamples' error while opens, counted up by each
	// call, is not yet positive.
	openErr  error
	opens    atomic.Int64
	failRead atomic.Bool // the next Read fails (once)
}

func (s *samplingEnforcer) OpenSamples() (PolicySamples, error) {
	if n := s.opens.Add(1); s.openErr != nil && n <= 0 {
		return nil, s.openErr
	}
	return &chanSamples{ch: s.samples, closed: make(chan struct{}), failRead: &s.failRead}, nil
}

type chanSamples struct {
	ch       chan []bridge.BlockedPacket
	once     sync.Once
	closed   chan struct{}
	failRead *atomic.Bool
}

func (c *chanSamples) Read() ([]bridge.BlockedPacket, error) {
	for !c.failRead.Load() {
		select {
		case bs := <-c.ch:
			return bs, nil
		case <-c.closed:
			return nil, errors.New("closed")
		case <-time.After(time.Millisecond):
		}
	}
	c.failRead.Store(false)
	return nil, errors.New("the reader fails as told")
}

func (c *chanSamples) Lost() uint64 { return 3 }
func (c *chanSamples) Close() error { c.once.Do(func() { close(c.closed) }); return nil }

func blocked(egress bool, proto uint8, src, dst string, sport, dport uint16) bridge.BlockedPacket {
	return bridge.BlockedPacket{Egress: egress, Protocol: proto, Src: netip.MustParseAddr(src), Dst: netip.MustParseAddr(dst), SrcPort: sport, DstPort: dport}
}

// TestPolicyLogsBlocked: the samples of the enforcer's drops become log
// lines that name the connection, the policies that isolate this node's
// pod in that direction, and the pods at both ends; a pair is logged once
// however often it is dropped.
func TestPolicyLogsBlocked(t *testing.T) {
	client := fake.NewClientset(namespace("default", nil),
		kpod("default", "web", "n1", "10.32.0.2", map[string]string{"app": "web"}),
		kpod("default", "client", "n2", "10.40.0.3", nil),
		kpod("default", "gone", "n2", "10.40.0.9", nil))
	gone, _ := client.CoreV1().Pods("default").Get(context.Background(), "gone", metav1.GetOptions{})
	gone.Status.Phase = "Succeeded"
	client.CoreV1().Pods("default").UpdateStatus(context.Background(), gone, metav1.UpdateOptions{})
	for _, name := range []string{"deny-all", "web-egress"} {
		np := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
			Spec: networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}}}
		if name == "web-egress" {
			np.Spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}
		}
		if _, err := client.NetworkingV1().NetworkPolicies("default").Create(context.Background(), np, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	enf := &samplingEnforcer{fakeEnforcer: newFakeEnforcer(), samples: make(chan []bridge.BlockedPacket)}
	w, reg, log := startPolicyWatch(t, client, enf)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.runSamples(ctx) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Errorf("runSamples did not return within 10 s of its context's end")
		}
	}()
	waitUntil(t, "the web pod isolated both ways", func() bool {
		nr := enf.last()
		if nr == nil {
			return false
		}
		pr := nr.Pods[netip.MustParseAddr("10.32.0.2")]
		return pr != nil && len(pr.Ingress.Policies) == 2 && len(pr.Egress.Policies) == 1
	})
	send := func(bs ...bridge.BlockedPacket) { enf.samples <- bs }
	in := blocked(false, 6, "10.40.0.3", "10.32.0.2", 41234, 80)
	in2 := in
	in2.SrcPort = 41235
	send(in, in2) // the same pair: one line
	send(blocked(true, 17, "10.32.0.2", "10.40.0.9", 5353, 53))
	send(blocked(false, 1, "10.99.0.1", "10.32.0.7", 0, 0)) // no pod of this node has the address
	want := []string{
		`msg="network policy: TCP 10.40.0.3:41234 -> 10.32.0.2:80 blocked by policies default/deny-all, default/web-egress (ingress)" from-pod=default/client to-pod=default/web`,
		`msg="network policy: UDP 10.32.0.2:5353 -> 10.40.0.9:53 blocked by policy default/web-egress (egress)" from-pod=default/web` + "\n",
		`msg="network policy: ICMP 10.99.0.1 -> 10.32.0.7 blocked by NetworkPolicy (ingress)"` + "\n",
	}
	waitUntil(t, "the blocked connections logged", func() bool {
		for _, s := range want {
			if !strings.Contains(log.String(), s) {
				return false
			}
		}
		return true
	})
	if n := strings.Count(log.String(), "10.40.0.3:"); n != 1 {
		t.Errorf("the pair client -> web was logged %d times, want once:\n%s", n, log.String())
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP weft_policy_blocked_log_total Log lines of blocked connections: logged; left out over the per-minute limit; samples lost before the router read them (the kernel's socket buffer full).
# TYPE weft_policy_blocked_log_total counter
weft_policy_blocked_log_total{result="left_out"} 0
weft_policy_blocked_log_total{result="logged"} 3
weft_policy_blocked_log_total{result="lost"} 3
`), "weft_policy_blocked_log_total"); err != nil {
		t.Error(err)
	}
	var out strings.Builder
	WritePolicy(&out, w.report())
	if want := "  Blocked connections: logged (nflog group 6784; 3 lines, 0 left out over 120 a minute, 3 samples lost)\n"; !strings.Contains(out.String(), want) {
		t.Errorf("weft status policy:\n%s\nwant the line\n%s", out.String(), want)
	}
}

// TestPolicyLogsWithoutSamples: a sampler that does not open is said
// once, shown in the report, and tried again until it opens; a reader
// that fails is opened again.
func TestPolicyLogsWithoutSamples(t *testing.T) {
	log := &syncbuf.Buffer{}
	enf := &samplingEnforcer{fakeEnforcer: newFakeEnforcer(), samples: make(chan []bridge.BlockedPacket),
		openErr: errors.New("bind nflog group 6784: operation not permitted")}
	enf.opens.Store(-20) // fails 20 times, then opens
	w := &policyWatch{log: slog.New(slog.NewTextHandler(log, nil)), enf: enf, retryMin: time.Millisecond, retryMax: 2 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.runSamples(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	waitUntil(t, "the failure in the report", func() bool {
		rep := w.blockedLogReport()
		return !rep.On && strings.Contains(rep.Error, "operation not permitted")
	})
	waitUntil(t, "the sampler opened after its failures", func() bool { return w.blockedLogReport().On })
	// The report turns on just before the line is written (runSamples):
	// wait for the line, not for the report alone.
	waitUntil(t, "a line when it opened", func() bool { return strings.Contains(log.String(), "logging blocked connections again") })
	if n := strings.Count(log.String(), "blocked connections are not logged"); n != 1 {
		t.Errorf("the failure was logged %d times over 20 tries, want once:\n%s", n, log.String())
	}
	// The reader fails: opened again.
	enf.failRead.Store(true)
	waitUntil(t, "the reader opened again after it failed", func() bool {
		return strings.Contains(log.String(), "reading them: the reader fails as told") && w.blockedLogReport().On
	})
}

// TestBlockLoggerLimits: one line per pair per minute; at most
// policyLogMax lines a minute, and the rest counted in one line when the
// minute is over, with the samples the kernel lost.
func TestBlockLoggerLimits(t *testing.T) {
	log := &syncbuf.Buffer{}
	now := time.Unix(1000, 0)
	l := newBlockLogger(slog.New(slog.NewTextHandler(log, nil)), func(b bridge.BlockedPacket) (string, []any) { return "blocked " + b.String(), nil })
	l.now = func() time.Time { return now }
	lines := func() int { return strings.Count(log.String(), "msg=\"blocked ") }
	a := blocked(false, 6, "10.40.0.3", "10.32.0.2", 1, 80)
	l.sample(a, 0)
	now = now.Add(30 * time.Second)
	l.sample(a, 0)
	if lines() != 1 {
		t.Fatalf("a pair twice within a minute: %d lines", lines())
	}
	now = now.Add(31 * time.Second)
	l.sample(a, 0)
	if lines() != 2 {
		t.Fatalf("a pair again after a minute: %d lines, want 2", lines())
	}
	// A scan: policyLogMax+10 pairs in one minute.
	for i := range policyLogMax + 10 {
		l.sample(blocked(true, 6, "10.32.0.2", fmt.Sprintf("10.40.%d.%d", i/250, i%250+1), 1, 22), 5)
	}
	if got := lines(); got != 2+policyLogMax-1 {
		t.Errorf("a scan of %d pairs: %d lines in the minute, want %d", policyLogMax+10, got, 2+policyLogMax-1)
	}
	if strings.Contains(log.String(), "not logged") {
		t.Errorf("the summary came before the minute was over:\n%s", log.String())
	}
	now = now.Add(time.Minute)
	l.tick() // the minute is over: said without another sample
	if !strings.Contains(log.String(), "network policy: 11 more blocked connections were not logged in the last minute (at most 120 lines a minute), and 5 samples were lost") {
		t.Errorf("no summary of the minute:\n%s", log.String())
	}
	if len(l.last) != 0 {
		t.Errorf("%d pairs remembered after the window rolled, want none", len(l.last))
	}
	l.tick()
	if n := strings.Count(log.String(), "not logged"); n != 1 {
		t.Errorf("the summary came %d times, want once:\n%s", n, log.String())
	}
	if lines, over, lost := l.totals(); lines != 2+policyLogMax-1 || over != 11 || lost != 5 {
		t.Errorf("totals: %d lines, %d left out, %d lost; want %d, 11, 5", lines, over, lost, 2+policyLogMax-1)
	}
}
