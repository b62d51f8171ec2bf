package router

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/testutils"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/policy"
)

var (
	benchPolicyPods  = flag.Int("router.policy-bench-pods", 1000, "pods of BenchmarkPolicyPropagation, spread over its nodes")
	benchPolicyNodes = flag.Int("router.policy-bench-nodes", 3, "nodes of BenchmarkPolicyPropagation")
)

// timedEnforcer is a real bridge.PolicyTable in a namespace of its own
// that keeps the rules of each successful Sync with the time it ended.
type timedEnforcer struct {
	t *bridge.PolicyTable

	mu      sync.Mutex
	applied []timedRules
	changed chan struct{} // closed and replaced at each success
}

type timedRules struct {
	at time.Time
	nr *policy.NodeRules
}

func (e *timedEnforcer) Sync(nr *policy.NodeRules) error {
	if err := e.t.Sync(nr); err != nil {
		return err
	}
	e.mu.Lock()
	e.applied = append(e.applied, timedRules{time.Now(), nr})
	close(e.changed)
	e.changed = make(chan struct{})
	e.mu.Unlock()
	return nil
}
func (e *timedEnforcer) Blocked() (uint64, uint64, error) { return e.t.Blocked() }
func (e *timedEnforcer) Teardown() error                  { return e.t.Teardown() }

// appliedWhen waits until a Sync that ended after since applied rules
// for which ok holds, and returns when it ended.
func (e *timedEnforcer) appliedWhen(ctx context.Context, since time.Time, ok func(*policy.NodeRules) bool) (time.Time, error) {
	for {
		e.mu.Lock()
		for _, a := range e.applied {
			if a.at.After(since) && ok(a.nr) {
				e.mu.Unlock()
				return a.at, nil
			}
		}
		ch := e.changed
		e.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
	}
}

// forget drops what was applied before t.
func (e *timedEnforcer) forget(t time.Time) {
	e.mu.Lock()
	e.applied = slices.DeleteFunc(e.applied, func(a timedRules) bool { return !a.at.After(t) })
	e.mu.Unlock()
}

// BenchmarkPolicyPropagation (root): the time from a change in the API
// (as the informers see it: a fake clientset) to rules applied in the
// kernel of every node (3 nodes, each a policy watch with a real
// bridge.PolicyTable in a network namespace of its own), with 1,000 pods
// (pod j on node j % 3, label app=a<j % 100>) and 100 or 1,000 policies
// (policy i selects app=a<i % 100>, ingress from role=client on TCP 80).
// Two changes alternate: a pod labelled role=client or not (every node's
// rules get or lose its address as a peer), and a new policy selecting
// one app on a new port (every node has pods of every app). It reports
// the p50 and p99 over the iterations of the time until the last node
// applied the change, and the mean per node.
func BenchmarkPolicyPropagation(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: real nftables tables in network namespaces")
	}
	for _, policies := range []int{100, 1000} {
		b.Run(fmt.Sprintf("policies=%d", policies), func(b *testing.B) { benchPropagation(b, *benchPolicyNodes, *benchPolicyPods, policies) })
	}
}

func benchPropagation(b *testing.B, nodes, pods, policies int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset(namespace("default", nil))
	addr := func(j int) netip.Addr {
		return netip.AddrFrom4([4]byte{10, 32 + byte(j/60000), byte(j / 250 % 240), byte(2 + j%250)})
	}
	for j := range pods {
		p := kpod("default", fmt.Sprintf("p%d", j), fmt.Sprintf("n%d", j%nodes), addr(j).String(), map[string]string{"app": fmt.Sprintf("a%d", j%100)})
		if _, err := client.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	tcp := corev1.ProtocolTCP
	mkpol := func(name, app string, port int32) *networkingv1.NetworkPolicy {
		pt := intstr.FromInt32(port)
		return &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": app}},
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From:  []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"role": "client"}}}},
					Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &pt}},
				}},
			}}
	}
	for i := range policies {
		if _, err := client.NetworkingV1().NetworkPolicies("default").Create(ctx, mkpol(fmt.Sprintf("pol%d", i), fmt.Sprintf("a%d", i%100), 80), metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	enfs := make([]*timedEnforcer, nodes)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for i := range nodes {
		n, err := testutils.NewNS()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			_ = n.Close()
			if err := testutils.UnmountNS(n); err != nil {
				b.Errorf("remove test namespace: %v", err)
			}
		})
		pt, err := bridge.NewPolicyTable(bridge.PolicyConfig{NSPath: n.Path()})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { pt.Close() })
		enfs[i] = &timedEnforcer{t: pt, changed: make(chan struct{})}
		w, err := newPolicyWatch(client, fmt.Sprintf("n%d", i), enfs[i], slog.New(slog.DiscardHandler), nil, 0)
		if err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = w.Run(ctx) }()
	}
	// Every node has applied the whole world once.
	start := time.Now()
	isolatedAll := func(nr *policy.NodeRules) bool {
		n := 0
		for _, pr := range nr.Pods {
			if pr.Ingress.Isolated {
				n++
			}
		}
		return n == len(nr.Pods) && n >= pods/nodes
	}
	for i, e := range enfs {
		if _, err := e.appliedWhen(ctx, time.Time{}, isolatedAll); err != nil {
			b.Fatalf("n%d: %v", i, err)
		}
	}
	b.Logf("%d nodes applied %d pods and %d policies in %v", nodes, pods, policies, time.Since(start).Round(time.Millisecond))

	hasPeer := func(a netip.Addr) func(*policy.NodeRules) bool {
		return func(nr *policy.NodeRules) bool {
			for _, pr := range nr.Pods {
				for _, r := range pr.Ingress.Rules {
					for _, iv := range r.Peers {
						if !a.Less(iv.Lo) && !iv.Hi.Less(a) {
							return true
						}
					}
				}
			}
			return false
		}
	}
	hasPort := func(port uint16) func(*policy.NodeRules) bool {
		return func(nr *policy.NodeRules) bool {
			for _, pr := range nr.Pods {
				for _, r := range pr.Ingress.Rules {
					for _, p := range r.Ports {
						if p.Lo == port {
							return true
						}
					}
				}
			}
			return false
		}
	}
	var last, perNode []time.Duration
	b.ResetTimer()
	for k := range b.N {
		t0 := time.Now()
		for _, e := range enfs {
			e.forget(t0)
		}
		var ok func(*policy.NodeRules) bool
		if k%2 == 0 {
			// Pod k: role=client on or off.
			j := k % pods
			p, err := client.CoreV1().Pods("default").Get(ctx, fmt.Sprintf("p%d", j), metav1.GetOptions{})
			if err != nil {
				b.Fatal(err)
			}
			on := p.Labels["role"] != "client"
			if on {
				p.Labels["role"] = "client"
				ok = hasPeer(addr(j))
			} else {
				delete(p.Labels, "role")
				peer := hasPeer(addr(j))
				ok = func(nr *policy.NodeRules) bool { return !peer(nr) }
			}
			if _, err := client.CoreV1().Pods("default").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
				b.Fatal(err)
			}
		} else {
			port := uint16(10000 + k)
			if _, err := client.NetworkingV1().NetworkPolicies("default").Create(ctx, mkpol(fmt.Sprintf("new%d", k), fmt.Sprintf("a%d", k%100), int32(port)), metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			ok = hasPort(port)
		}
		var max time.Duration
		for i, e := range enfs {
			at, err := e.appliedWhen(ctx, t0, ok)
			if err != nil {
				b.Fatalf("n%d, change %d: %v", i, k, err)
			}
			d := at.Sub(t0)
			perNode = append(perNode, d)
			if d > max {
				max = d
			}
		}
		last = append(last, max)
	}
	b.StopTimer()
	slices.Sort(last)
	var sum time.Duration
	for _, d := range perNode {
		sum += d
	}
	b.ReportMetric(float64(last[len(last)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(last[(len(last)*99)/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(sum.Microseconds())/float64(len(perNode))/1000, "node-mean-ms")
}
