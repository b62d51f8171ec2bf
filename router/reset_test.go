package router

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/ipalloc"
)

func TestLocalAPIReset(t *testing.T) {
	r, cl := newTestRouter(t, "10.32.0.0/24")
	r.setReady(true, "")
	ctx := context.Background()
	conf := filepath.Join(r.cfg.CNIConfDir, ConfListName)
	if err := os.MkdirAll(r.cfg.CNIConfDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(conf, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "c1", IfName: "eth0"}}); err != nil {
		t.Fatal(err)
	}
	// A pod holds an address: refused, and nothing changes.
	_, err := cl.Reset(ctx, false)
	if !api.IsCode(err, api.CodeConflict) || !strings.Contains(err.Error(), "c1/eth0") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("reset with a pod: %v", err)
	}
	if ok, _ := r.Ready(); !ok || len(r.resetCh) != 0 {
		t.Fatal("a refused reset changed the router")
	}
	if _, err := os.Stat(conf); err != nil {
		t.Fatal("a refused reset removed the CNI config")
	}
	// Forced: alone, there is nobody to hand over to.
	res, err := cl.Reset(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	if res.Heir != "" || res.Dropped != 1 || !strings.Contains(res.Message, "nothing to hand over") || !strings.Contains(res.Message, "1 pod addresses dropped") {
		t.Errorf("reset: %+v", res)
	}
	if len(r.resetCh) != 1 {
		t.Error("the router was not told to tear down")
	}
	if _, err := os.Stat(conf); !os.IsNotExist(err) {
		t.Errorf("the CNI config is still there: %v", err)
	}
	if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "c2", IfName: "eth0"}}); !api.IsCode(err, api.CodeNotReady) {
		t.Errorf("allocate after reset: %v", err)
	}
	if got := r.Report().IPAM.Status; got != "left the cluster (weft reset)" {
		t.Errorf("status: %q", got)
	}
}

func TestFoundAddrs(t *testing.T) {
	pods := netip.MustParsePrefix("10.32.0.0/12")
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	seen := bridgeSeen{
		Ports: 2,
		Addrs: []netip.Prefix{netip.MustParsePrefix("192.168.1.1/24"), netip.MustParsePrefix("10.32.0.1/12")},
		Neighbors: []netip.Addr{
			a("10.32.0.5"), a("10.32.0.1"), a("10.32.0.0"), a("10.47.255.255"), a("10.48.0.1"), a("192.168.1.7"),
			netip.AddrFrom16(a("10.32.0.6").As16()),
		},
	}
	got := foundAddrs("weft", pods, seen)
	rk := func(s string) ipalloc.Key {
		ad, _ := ipalloc.AddressFrom(a(s))
		return ipalloc.ReclaimedKey("weft", ad)
	}
	want := map[ipalloc.Key]netip.Addr{
		ipalloc.GatewayKey("weft"): a("10.32.0.1"),
		rk("10.32.0.5"):            a("10.32.0.5"),
		rk("10.32.0.6"):            a("10.32.0.6"),
	}
	if len(got) != len(want) {
		t.Fatalf("foundAddrs = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s, want %s", k, got[k], v)
		}
	}
	seen.Ports = 0
	if got := foundAddrs("weft", pods, seen); len(got) != 0 {
		t.Errorf("a bridge without ports: %v", got)
	}
}

func TestLocalAPIReleaseReclaimed(t *testing.T) {
	r, cl := newTestRouter(t, "10.32.0.0/24")
	r.setReady(true, "")
	ctx := context.Background()
	pod := netip.MustParseAddr("10.32.0.40")
	ad, _ := ipalloc.AddressFrom(pod)
	if err := r.ipam.HoldFound(map[ipalloc.Key]netip.Addr{ipalloc.ReclaimedKey("weft", ad): pod}); err != nil {
		t.Fatal(err)
	}
	if got := r.Report().IPAM.Allocations; len(got) != 1 || got[0].Address != "10.32.0.40" {
		t.Errorf("report: %+v", got)
	}
	att := api.Attachment{ContainerID: "old", IfName: "eth0"}
	// The query is the edge: text that is no IPv4 address is refused
	// (the typed client cannot send it, a raw request can).
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", cl.Socket())
	}}}
	for _, bad := range []string{"not-an-ip", "fd00::1", "10.32.0.40%25eth0"} {
		req, _ := http.NewRequest(http.MethodDelete, "http://weft"+api.PathIP+"?containerID=old&ifName=eth0&"+api.QueryAddress+"="+bad, nil)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"code":"invalid"`) {
			t.Errorf("release with address=%s: %s %s", bad, resp.Status, b)
		}
	}
	rel, err := cl.ReleaseWithPrev(ctx, att, netip.MustParseAddr("10.32.0.40"))
	if err != nil || !rel.Released || rel.Address != pod {
		t.Fatalf("release with prev: %+v, %v", rel, err)
	}
	if r.ipam.Stats().Allocated != 0 {
		t.Error("the re-claimed address is still held")
	}
	// A held attachment is released as usual; prev is then ignored.
	a, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att})
	if err != nil {
		t.Fatal(err)
	}
	if rel, err := cl.ReleaseWithPrev(ctx, att, netip.MustParseAddr("10.32.0.99")); err != nil || !rel.Released || rel.Address != a.Address.Addr() {
		t.Errorf("release: %+v, %v (had %s)", rel, err, a.Address)
	}
}

func TestWriteIPAMReclaims(t *testing.T) {
	var rep Report
	rep.IPAM.Owners = []OwnerReport{{Peer: "a", Nickname: "n0", Size: 64, Percent: 100, Reach: true}}
	rep.IPAM.Reclaims = map[string][]string{"d": {"b", "c"}}
	var b strings.Builder
	WriteIPAM(&b, rep)
	if !strings.Contains(b.String(), "removing d: waiting for b, c to stop listening to it") {
		t.Errorf("WriteIPAM:\n%s", b.String())
	}
}

// TestResetWaitsForTheHold: weft reset on a peer that still holds back
// after its start (it has not heard the ring from the peer it shares it
// with) waits for the hold to end instead of handing over ranges it may
// no longer own, and gives up with the reason at its deadline.
func TestResetWaitsForTheHold(t *testing.T) {
	c := validConfig(t)
	c.IPAllocRange, c.Name, c.IPAllocInit = "10.32.0.0/24", "self", "seed=self,other"
	v, err := c.Validate()
	if err != nil {
		t.Fatal(err)
	}
	var log syncbuf.Buffer
	r, err := New(v, slog.New(slog.NewTextHandler(&log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.db.Close() })
	r.netState = netState{host: netip.MustParseAddr("10.250.0.1"), mtu: 1440, gateway: netip.MustParsePrefix("10.32.0.1/24")}
	if err := r.openIPAM(context.Background()); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(context.Background(), 3*leaveHoldPoll)
	defer cancel()
	if _, err := r.leave(short, true); !errors.Is(err, ipalloc.ErrHolding) {
		t.Fatalf("reset in the hold, at its deadline: %v, want ErrHolding", err)
	}
	// The ring from the other seed ends the hold while a reset waits: the
	// reset goes on (and finds no live heir: this router has no mesh).
	ring := ipalloc.NewRing(ipalloc.RangeOf(netip.MustParsePrefix("10.32.0.0/24")))
	if err := ring.ClaimEvenly([]ipalloc.PeerName{"self", "other"}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, err := r.leave(ctx, true)
		done <- err
	}()
	for n := 0; strings.Count(log.String(), "weft reset: waiting until this peer has heard the ring") < 2; n++ {
		select {
		case err := <-done:
			t.Fatalf("reset in the hold did not wait: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := r.ipam.Step("other", ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: ring})); err != nil {
		t.Fatal(err)
	}
	// A rejoining owner also waits for the other owner's members
	// (ipalloc/peer_rejoin.go), which it asks for on its ring.
	if err := r.ipam.Step("other", ipalloc.EncodeMsg(&ipalloc.Members{Peers: []ipalloc.PeerName{"self"}})); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ipalloc.ErrNoHeir) {
		t.Fatalf("reset once the hold ended: %v, want ErrNoHeir", err)
	}
}
