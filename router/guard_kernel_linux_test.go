package router

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/google/nftables"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/cni"
)

// nsGuardKernel is a Kernel whose guard is the real one, in a network
// namespace the test made: its guard methods are HostKernel's code (a
// lasting bridge.GuardConn) pointed at that namespace; the rest is the
// fake's (the test's router ensures no bridge through it).
type nsGuardKernel struct {
	*fakeKernel
	g       *bridge.GuardConn
	batches atomic.Int64 // AddPodSources calls
}

func (k *nsGuardKernel) SetGuardPeers(addrs []netip.Addr) (int, int, error) {
	return k.g.SetPeerAddrs(addrs)
}

func (k *nsGuardKernel) SetGuardOwnRanges(ranges []bridge.AddrRange) (bool, error) {
	return k.g.SetOwnRanges(ranges)
}

func (k *nsGuardKernel) SetPodSources(want []bridge.PodSource, keep func(bridge.PodSource) bool) ([]bridge.PodSource, []bridge.PodSource, error) {
	return k.g.SetPodSources(want, keep)
}

func (k *nsGuardKernel) AddPodSources(ps []bridge.PodSource) error {
	k.batches.Add(1)
	return k.g.AddPodSources(ps)
}

func (k *nsGuardKernel) RemovePodSource(p bridge.PodSource) (bool, error) {
	return k.g.RemovePodSource(p)
}

func (k *nsGuardKernel) GuardDrops() (map[string]uint64, error) { return k.g.DropCounts() }

func (k *nsGuardKernel) PolicyTable() (PolicyEnforcer, error) { return newFakeEnforcer(), nil }

// guardedNS makes a network namespace with weft's bridge and its guard
// (bridge.Ensure with a Guard, as a router starting there does) and gives
// a kernel whose guard is in it. Everything goes with the test.
func guardedNS(t testing.TB) (ns.NetNS, *nsGuardKernel) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create a network namespace with weft's bridge and nftables guard")
	}
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("create test namespace: %v", err)
	}
	t.Cleanup(func() {
		_ = n.Close()
		if err := testutils.UnmountNS(n); err != nil {
			t.Errorf("remove test namespace: %v", err)
		}
	})
	cfg := bridge.Config{
		Name: "weft", MTU: 1440, Gateway: netip.MustParsePrefix("10.32.0.1/12"), PodRange: netip.MustParsePrefix("10.32.0.0/12"),
		Guard: bridge.Guard{GossipPort: 6783, DataPort: 6784},
	}
	if _, err := bridge.Ensure(n.Path(), cfg, nil); err != nil {
		t.Fatalf("bridge.Ensure in the test namespace: %v", err)
	}
	k := &nsGuardKernel{fakeKernel: &fakeKernel{}, g: bridge.NewGuardConn(n.Path())}
	t.Cleanup(func() { k.g.Close() })
	return n, k
}

// kernelPodSources reads the guard's pods set of namespace n, on a
// connection of its own.
func kernelPodSources(t testing.TB, n ns.NetNS) []bridge.PodSource {
	t.Helper()
	fd, err := os.Open(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(fd.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.GetSetByName(&nftables.Table{Family: nftables.TableFamilyBridge, Name: bridge.TableName}, "pods")
	if err != nil {
		t.Fatal(err)
	}
	els, err := c.GetSetElements(s)
	if err != nil {
		t.Fatal(err)
	}
	var out []bridge.PodSource
	for _, e := range els {
		if len(e.Key) != 20 {
			t.Fatalf("pods set element % x", e.Key)
		}
		name := string(e.Key[:16])
		if i := slices.Index(e.Key[:16], 0); i >= 0 {
			name = string(e.Key[:i])
		}
		out = append(out, bridge.PodSource{Veth: name, Addr: netip.AddrFrom4([4]byte(e.Key[16:]))})
	}
	return out
}

// TestLocalAPIGuardOrderKernel: with the real guard (nftables in a
// namespace), every ADD's pod source is in the kernel's pods set when the
// local API answers it, also when 20 ADDs share batches, and a DEL takes
// out its own entry only.
func TestLocalAPIGuardOrderKernel(t *testing.T) {
	n, k := guardedNS(t)
	r, cl := newTestRouter(t, "10.32.0.0/12")
	r.kernel = k
	r.setReady(true, "")
	ctx := context.Background()

	const adds = 20
	srcs := make([]bridge.PodSource, adds)
	errs := make([]error, adds)
	var wg sync.WaitGroup
	for i := range adds {
		wg.Go(func() {
			att := api.Attachment{ContainerID: fmt.Sprintf("order-%d", i), IfName: "eth0"}
			a, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID})
			if err != nil {
				errs[i] = err
				return
			}
			srcs[i] = bridge.PodSource{Veth: cni.HostVethName(att.ContainerID, att.IfName), Addr: a.Address.Addr()}
			if !slices.Contains(kernelPodSources(t, n), srcs[i]) {
				errs[i] = fmt.Errorf("answered before its source %v was in the kernel's set", srcs[i])
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("ADD %d: %v", i, err)
		}
	}
	if t.Failed() {
		return
	}
	if _, err := cl.Release(ctx, api.Attachment{ContainerID: "order-3", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
	got := kernelPodSources(t, n)
	if len(got) != adds-1 || slices.Contains(got, srcs[3]) {
		t.Errorf("after the DEL of %v the set is %v, want the other %d", srcs[3], got, adds-1)
	}
}

// BenchmarkLocalAPIAllocate20Guarded is BenchmarkLocalAPIAllocate20 with
// the guard a real router has: the bridge and its nftables guard in a
// network namespace the benchmark makes, so that every ADD's pod source is
// written to the kernel's set (in BenchmarkLocalAPIAllocate20 there is no
// guard set, and the guard's batch ends at the lookup that finds none).
// Needs root.
//
//	go test ./router -run '^$' -bench LocalAPIAllocate20Guarded -benchtime 2000x
func BenchmarkLocalAPIAllocate20Guarded(b *testing.B) {
	n, k := guardedNS(b)
	r, cl := newTestRouter(b, "10.32.0.0/12")
	r.kernel = k
	allocate20(b, r, cl)
	b.StopTimer()
	b.ReportMetric(float64(k.batches.Load())/float64(b.N), "guard-batches/op")
	if got := len(kernelPodSources(b, n)); got < b.N {
		b.Fatalf("the guard's set has %d entries after %d ADDs", got, b.N)
	}
}
