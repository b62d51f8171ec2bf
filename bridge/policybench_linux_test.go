package bridge

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"

	"github.com/weft-net/weft/policy"
)

// benchRules are scaleRules(1000, policies) with pods A and B isolated
// both ways by a policy of their own, default/bench, that lets A reach B
// on TCP 80 and 5201 (iperf3): the traffic the benchmark measures goes
// through the ingress and egress maps and a chain with set lookups each
// way, in a table that holds the chains and sets of the 1,000 pods'
// policies.
func benchRules(policies int) *policy.NodeRules {
	nr := scaleRules(1000, policies, false)
	ports := []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}, {Protocol: corev1.ProtocolTCP, Lo: 5201, Hi: 5201}}
	nr.Pods[podA].Egress = policy.Direction{Isolated: true, Policies: []string{"default/bench"}, Rules: []policy.Rule{
		{Peers: []policy.Interval{{Lo: podB, Hi: podB}}, Ports: ports, From: policy.Origin{Policy: "default/bench", Egress: true}}}}
	nr.Pods[podB].Ingress = policy.Direction{Isolated: true, Policies: []string{"default/bench"}, Rules: []policy.Rule{
		{Peers: []policy.Interval{{Lo: podA, Hi: podA}}, Ports: ports, From: policy.Origin{Policy: "default/bench"}}}}
	return nr
}

// policyBenchCases are the tables the data path is measured with, side
// by side in one run: no policy table ("none"); A and B isolated by
// their own policy in a table of 1,000 pods that 1 policy selects
// ("1-policy"); the same with 1,000 policies (2,000 chains, 4,000 sets:
// nothing shared).
var policyBenchCases = []struct {
	name     string
	policies int
}{{"none", 0}, {"1-policy", 1}, {"1000-policies", 1000}}

// policyBenchEnv is a node with pods A to D and, for policies > 0, the
// table of benchRules(policies).
func policyBenchEnv(b *testing.B, name string, policies int) *polEnv {
	skipUnlessRootB(b)
	p := newPolEnv(b)
	p.log = slog.New(slog.DiscardHandler)
	if policies == 0 {
		return p
	}
	pt, err := NewPolicyTable(PolicyConfig{NSPath: p.ns.Path()})
	if err != nil {
		b.Fatal(err)
	}
	defer pt.Close()
	start := time.Now()
	if err := pt.Sync(benchRules(policies)); err != nil {
		b.Fatal(err)
	}
	b.Logf("%s: table of %d chains, %d sets written in %v", name, len(pt.have.chains), len(pt.have.peerSets)+len(pt.have.portSets), time.Since(start).Round(time.Millisecond))
	p.pt = pt
	if p.try(b, podC, podB, corev1.ProtocolTCP, 80) {
		b.Fatalf("%s: C reached B; the policies should isolate B", name)
	}
	return p
}

// BenchmarkPolicyConnect (root): what NetworkPolicy costs a new
// connection between two pods of one node (A to B:80, bridged), for each
// of policyBenchCases: every SYN goes through the maps and a chain each
// way. An iteration is one TCP connect and close (ns/op, p50, p99).
func BenchmarkPolicyConnect(b *testing.B) {
	for _, c := range policyBenchCases {
		p := policyBenchEnv(b, c.name, c.policies)
		b.Run(c.name, func(b *testing.B) { benchConnect(b, p.pods[podA], podB) })
	}
}

// BenchmarkPolicyThroughput (root, iperf3): the same for an established
// connection (accepted by the forward chain's first rule): an iteration
// is one iperf3 run of 3 s, one stream A -> B; run it with -benchtime 3x.
func BenchmarkPolicyThroughput(b *testing.B) {
	if _, err := exec.LookPath("iperf3"); err != nil {
		b.Skip("needs iperf3 (make deps installs it)")
	}
	for _, c := range policyBenchCases {
		p := policyBenchEnv(b, c.name, c.policies)
		b.Run(c.name, func(b *testing.B) { benchIperf(b, p.pods[podA], p.pods[podB], podB) })
	}
}

// benchConnect opens and closes b.N TCP connections from n to dst:80.
func benchConnect(b *testing.B, n ns.NetNS, dst netip.Addr) {
	lat := make([]time.Duration, 0, b.N)
	addr := netip.AddrPortFrom(dst, 80).String()
	b.ResetTimer()
	err := n.Do(func(ns.NetNS) error {
		for range b.N {
			t0 := time.Now()
			c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
			if err != nil {
				return err
			}
			lat = append(lat, time.Since(t0))
			c.Close()
		}
		return nil
	})
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}

// benchIperf runs b.N iperf3 runs of 3 s, one stream, from client to
// server (listening on dst); it reports the mean received rate.
func benchIperf(b *testing.B, client, server ns.NetNS, dst netip.Addr) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute+time.Duration(b.N)*10*time.Second)
	defer cancel()
	srv := exec.CommandContext(ctx, "nsenter", "--net="+server.Path(), "iperf3", "-s", "-B", dst.String())
	if err := srv.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	var sum float64
	for i := range b.N {
		var out []byte
		var err error
		for try := 0; ; try++ { // until the server listens
			out, err = exec.CommandContext(ctx, "nsenter", "--net="+client.Path(), "iperf3", "-c", dst.String(), "-t", "3", "-J").Output()
			if err == nil || try == 50 || !strings.Contains(string(out), "Connection refused") {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			b.Fatalf("iperf3 run %d: %v\n%s", i, err, out)
		}
		var res struct {
			End struct {
				SumReceived struct {
					BitsPerSecond float64 `json:"bits_per_second"`
				} `json:"sum_received"`
			} `json:"end"`
		}
		if err := json.Unmarshal(out, &res); err != nil {
			b.Fatalf("iperf3 output: %v\n%s", err, out)
		}
		sum += res.End.SumReceived.BitsPerSecond
	}
	b.ReportMetric(sum/float64(b.N)/1e9, "Gbit/s")
	b.ReportMetric(0, "ns/op")
}
