package ipalloc

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/weft-net/weft/state"
)

var testNow = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// svcEnv is one peer's state dir, reopened as a router restart would.
type svcEnv struct {
	t        testing.TB
	dir      string
	universe string
	log      lockedBuffer // everything every service of this env logged
	db       *state.DB
	svc      *Service
	stopLoop func() // ends the running service's owner loop (withLoop)
}

func newSvcEnv(t testing.TB, universe string) *svcEnv {
	return &svcEnv{t: t, dir: t.TempDir(), universe: universe}
}

// logger writes text records, debug and up, into e.log.
func (e *svcEnv) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(&e.log, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// start opens the state and a Service on it, as a router start does.
func (e *svcEnv) start() (*Service, error) {
	e.t.Helper()
	db, err := state.Open(e.dir)
	if err != nil {
		e.t.Fatal(err)
	}
	e.db = db
	e.t.Cleanup(func() { db.Close() })
	svc, err := NewService(ServiceConfig{
		Self:     "self",
		Universe: netip.MustParsePrefix(e.universe),
		DB:       db,
		Log:      e.logger(),
		Now:      func() time.Time { return testNow },
	})
	e.svc = svc
	if err == nil && withLoop {
		e.stopLoop = runLoop(e.t, svc)
	}
	return svc, err
}

// mustStart is start that fails the test on error.
func (e *svcEnv) mustStart() *Service {
	e.t.Helper()
	svc, err := e.start()
	if err != nil {
		e.t.Fatal(err)
	}
	return svc
}

// restart closes the state, as a stop of the router does, and starts again.
func (e *svcEnv) restart() *Service {
	e.t.Helper()
	if e.stopLoop != nil {
		e.stopLoop()
		e.stopLoop = nil
	}
	if err := e.db.Close(); err != nil {
		e.t.Fatal(err)
	}
	return e.mustStart()
}

func (e *svcEnv) mustAllocate(k Key) netip.Addr {
	e.t.Helper()
	addr, _, err := e.svc.Allocate(context.Background(), k, Meta{PodNamespace: "ns", PodName: "pod-" + k.ContainerID, Netns: "/var/run/netns/" + k.ContainerID})
	if err != nil {
		e.t.Fatal(err)
	}
	return addr
}

func TestServiceFirstStart(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/12")
	svc := e.mustStart()
	const want = "ipalloc: owning 10.32.0.0/12 (1048576 addresses, 100% of range)"
	if !strings.Contains(e.log.String(), want) {
		t.Errorf("log does not say %q:\n%s", want, e.log.String())
	}
	snap := svc.Snapshot()
	if snap.Self != "self" || snap.Universe.String() != "10.32.0.0/12" || len(snap.Owned) != 1 || snap.Owned[0] != rangeOf("10.32.0.0/12") {
		t.Errorf("Snapshot() = %+v", snap)
	}
	if want := (Stats{Owned: 1 << 20, Reserved: 2, Free: 1<<20 - 2}); snap.Stats != want {
		t.Errorf("Stats = %+v, want %+v", snap.Stats, want)
	}
	if svc.Universe() != netip.MustParsePrefix("10.32.0.0/12") {
		t.Errorf("Universe() = %s", svc.Universe())
	}
	a := e.mustAllocate(key(1))
	if p := svc.Prefix(addr(t, a.String())); p.Bits() != 12 || p.Addr() != a {
		t.Errorf("Prefix(%s) = %s", a, p)
	}
	// The universe and the ring are on disk before anything is handed out.
	if u, _ := e.db.Get(bucketIPAM, keyUniverse); string(u) != "10.32.0.0/12" {
		t.Errorf("saved universe %q", u)
	}
	if r, _ := e.db.Get(bucketIPAM, keyRing); len(r) == 0 {
		t.Error("no ring saved")
	}
}

func TestServicePersistence(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/12")
	e.mustStart()
	before := map[Key]netip.Addr{}
	gw := GatewayKey("weft")
	before[gw] = e.mustAllocate(gw)
	for i := range 40 {
		before[key(i)] = e.mustAllocate(key(i))
	}
	e.log.Reset()
	svc := e.restart()
	if !strings.Contains(e.log.String(), "restored allocations") || !strings.Contains(e.log.String(), "count=41") {
		t.Errorf("restart did not log the restore:\n%s", e.log.String())
	}
	if !strings.Contains(e.log.String(), "ipalloc: owning 10.32.0.0/12") {
		t.Errorf("restart did not log the ownership:\n%s", e.log.String())
	}
	for k, want := range before {
		if got, ok := svc.Lookup(k); !ok || got != want {
			t.Errorf("after restart, Lookup(%s) = %s, %v; want %s", k, got, ok, want)
		}
		if got, isNew, err := svc.Allocate(context.Background(), k, Meta{}); err != nil || isNew || got != want {
			t.Errorf("after restart, Allocate(%s) = %s, %v, %v; want %s, false", k, got, isNew, err, want)
		}
	}
	snap := svc.Snapshot()
	if len(snap.Allocations) != 41 {
		t.Fatalf("%d allocations after restart, want 41", len(snap.Allocations))
	}
	for _, h := range snap.Allocations {
		if h.Key == gw {
			continue
		}
		if h.PodName != "pod-"+h.Key.ContainerID || h.PodNamespace != "ns" || !h.Created.Equal(testNow) {
			t.Errorf("metadata of %s after restart: %+v", h.Key, h.Meta)
		}
	}
	// New allocations never collide with restored ones.
	used := map[netip.Addr]Key{}
	for k, a := range before {
		used[a] = k
	}
	for i := 100; i < 140; i++ {
		a := e.mustAllocate(key(i))
		if other, ok := used[a]; ok {
			t.Fatalf("%s got %s, restored for %s", key(i), a, other)
		}
		used[a] = key(i)
	}
}

func TestServiceRelease(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	a1, a2 := e.mustAllocate(key(1)), e.mustAllocate(key(2))
	if got, ok, err := svc.Release(key(1)); err != nil || !ok || got != a1 {
		t.Fatalf("Release = %s, %v, %v; want %s", got, ok, err, a1)
	}
	if _, ok, err := svc.Release(key(1)); err != nil || ok {
		t.Fatalf("second Release = %v, %v; want false, nil", ok, err)
	}
	if _, ok, err := svc.Release(key(9)); err != nil || ok {
		t.Fatalf("Release of an unknown key = %v, %v", ok, err)
	}
	svc = e.restart()
	if _, ok := svc.Lookup(key(1)); ok {
		t.Fatal("a released key is back after restart")
	}
	if got, ok := svc.Lookup(key(2)); !ok || got != a2 {
		t.Fatalf("Lookup(%s) after restart = %s, %v", key(2), got, ok)
	}
}

func TestServiceGC(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	gw := GatewayKey("weft")
	if !gw.Internal() || key(1).Internal() {
		t.Fatal("Internal() is wrong")
	}
	held := map[Key]netip.Addr{gw: e.mustAllocate(gw)}
	for i := range 6 {
		held[key(i)] = e.mustAllocate(key(i))
	}
	keep := map[Key]bool{key(1): true, key(4): true}
	dropped, err := svc.GC([]Key{key(1), key(4)})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, al := range dropped {
		got = append(got, al.Key.String())
		if held[al.Key] != al.Address.Addr() {
			t.Errorf("GC reported %v, but the key held %s", al, held[al.Key])
		}
	}
	if want := []string{key(0).String(), key(2).String(), key(3).String(), key(5).String()}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("GC dropped %v, want %v", got, want)
	}
	// Nothing more to drop.
	if dropped, err := svc.GC([]Key{key(1), key(4)}); err != nil || len(dropped) != 0 {
		t.Errorf("second GC = %v, %v", dropped, err)
	}
	svc = e.restart()
	for k, a := range held {
		got, ok := svc.Lookup(k)
		if want := keep[k] || k == gw; ok != want || (ok && got != a) {
			t.Errorf("after GC and restart, Lookup(%s) = %s, %v; want held=%v (%s)", k, got, ok, want, a)
		}
	}
}

func TestServiceExhausted(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/28")
	svc := e.mustStart()
	for i := range 14 {
		e.mustAllocate(key(i))
	}
	a, isNew, err := svc.Allocate(context.Background(), key(99), Meta{})
	if !errors.Is(err, ErrNoSpace) || !ErrIsExhausted(err) || isNew || a.IsValid() {
		t.Fatalf("Allocate on a full range = %v, %v, %v; want no address and ErrNoSpace", a, isNew, err)
	}
	if _, ok := svc.Lookup(key(99)); ok {
		t.Fatal("a failed Allocate left the key holding an address")
	}
	if v, _ := e.db.Get(bucketAllocations, string(dbKey(key(99)))); v != nil {
		t.Fatalf("a failed Allocate saved %q", v)
	}
}

// TestServiceSaveFails checks that nothing is handed out or released that
// is not on disk: with the database closed under it, the service refuses.
func TestServiceSaveFails(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	held := e.mustAllocate(key(1))
	if err := e.db.Close(); err != nil {
		t.Fatal(err)
	}
	if a, _, err := svc.Allocate(context.Background(), key(2), Meta{}); err == nil || a.IsValid() {
		t.Fatalf("Allocate with the state closed = %v, %v; want an error", a, err)
	} else if !strings.Contains(err.Error(), key(2).String()) {
		t.Errorf("%q does not name the key", err)
	}
	if _, ok := svc.Lookup(key(2)); ok {
		t.Fatal("an allocation that was not saved is held")
	}
	if _, ok, err := svc.Release(key(1)); err == nil || ok {
		t.Fatalf("Release with the state closed = %v, %v; want an error", ok, err)
	}
	if _, err := svc.GC(nil); err == nil {
		t.Fatal("GC with the state closed succeeded")
	}
	// Memory and disk may now differ: the service answers nothing from
	// memory and asks for a restart, which rebuilds from disk.
	if err := svc.Err(); !errors.Is(err, ErrBroken) {
		t.Fatalf("Err() = %v, want ErrBroken", err)
	}
	if _, _, err := svc.Allocate(context.Background(), key(3), Meta{}); !errors.Is(err, ErrBroken) {
		t.Fatalf("Allocate on a broken service: %v", err)
	}
	svc = e.mustStart()
	if got, ok := svc.Lookup(key(1)); !ok || got != held {
		t.Fatal("a release or GC that was not saved took effect")
	}
	if _, ok := svc.Lookup(key(2)); ok {
		t.Fatal("an allocation that was not saved is held after the restart")
	}
}

func TestServiceRangeChanged(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/12")
	e.mustStart()
	e.mustAllocate(key(1))
	if err := e.db.Close(); err != nil {
		t.Fatal(err)
	}
	e.universe = "10.40.0.0/16"
	_, err := e.start()
	if !errors.Is(err, ErrBadRange) {
		t.Fatalf("NewService with another range: %v, want ErrBadRange", err)
	}
	for _, m := range []string{"10.32.0.0/12", "10.40.0.0/16", e.db.Path()} {
		if !strings.Contains(err.Error(), m) {
			t.Errorf("%q does not name %s", err, m)
		}
	}
}

func TestServiceCorruptAllocation(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	e.mustStart()
	good := Key{ContainerID: "a-good", IfName: "eth0"} // sorts before the bad ones
	goodAddr := e.mustAllocate(good)
	bad := map[string]string{
		"garbage":             "xx",                                           // a key without the separator
		"c1\x00eth0":          "{not json",                                    // not JSON
		"c2\x00eth0":          `{"address":"nope"}`,                           // not an address
		"c3\x00eth0":          `{"address":"10.99.0.1"}`,                      // outside the range
		"c4\x00eth0":          fmt.Sprintf(`{"address":%q}`, goodAddr),        // held by good
		"c5\x00eth0":          `{"address":"10.32.0.0"}`,                      // the network address
		"c6\x00eth0":          `{"address":"fd00::1"}`,                        // IPv6
		"c7\x00eth0":          `{"address":"10.32.0.77","podName":["array"]}`, // wrong type
		"c8\x00withnull\x00x": `{"address":"10.32.0.78"}`,                     // readable: IfName holds a NUL
	}
	for k, v := range bad {
		if err := e.db.Put(bucketAllocations, k, []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	e.log.Reset()
	svc := e.restart() // starts despite the bad records
	logged := e.log.String()
	if n := strings.Count(logged, "could not be restored") + strings.Count(logged, "cannot be restored"); n != len(bad)-1 {
		t.Errorf("logged %d bad records, want %d:\n%s", n, len(bad)-1, logged)
	}
	for _, m := range []string{`garbage`, `c1\\x00eth0`, "c2/eth0", "c3/eth0", "c4/eth0", "c5/eth0", "c6/eth0", `c7\\x00eth0`} {
		if !strings.Contains(logged, m) {
			t.Errorf("log does not name %s:\n%s", m, logged)
		}
	}
	if !strings.Contains(logged, "level=ERROR") {
		t.Errorf("bad records not logged as errors:\n%s", logged)
	}
	if got, ok := svc.Lookup(good); !ok || got != goodAddr {
		t.Errorf("Lookup(%s) = %s, %v; want %s", good, got, ok, goodAddr)
	}
	// Nothing was deleted.
	for k, v := range bad {
		if got, _ := e.db.Get(bucketAllocations, k); string(got) != v {
			t.Errorf("record %q is now %q, want it kept as %q", k, got, v)
		}
	}
	// Addresses of unreadable records are not known; the good one is still
	// never handed out again.
	for i := range 200 {
		a, _, err := svc.Allocate(context.Background(), key(i), Meta{})
		if err != nil {
			break
		}
		if a == goodAddr {
			t.Fatalf("%s got %s, held by %s", key(i), a, good)
		}
	}
}

func TestServiceCorruptRing(t *testing.T) {
	u := rangeOf("10.32.0.0/24")
	outside, _ := json.Marshal(Ring{Universe: u, Entries: []Entry{{Token: u.Start, Peer: "self"}, {Token: u.End + 5, Peer: "x"}}})
	otherUniverse, _ := json.Marshal(Ring{Universe: rangeOf("10.33.0.0/24"), Entries: []Entry{{Token: rangeOf("10.33.0.0/24").Start, Peer: "self"}}})
	tests := []struct {
		name    string
		data    string
		wantMsg string
	}{
		{"not JSON", "{garbage", "unreadable"},
		{"wrong type", `{"universe":"x"}`, "unreadable"},
		{"token outside", string(outside), "invalid"},
		{"other universe", string(otherUniverse), "invalid"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newSvcEnv(t, "10.32.0.0/24")
			e.mustStart()
			if err := e.db.Put(bucketIPAM, keyRing, []byte(tt.data)); err != nil {
				t.Fatal(err)
			}
			e.db.Close()
			_, err := e.start()
			if err == nil {
				t.Fatal("NewService with a corrupt ring succeeded")
			}
			for _, m := range []string{tt.wantMsg, "ring", e.db.Path()} {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("%q does not say %q", err, m)
				}
			}
			// The bad ring is left for the operator to look at.
			if got, _ := e.db.Get(bucketIPAM, keyRing); string(got) != tt.data {
				t.Errorf("ring record changed to %q", got)
			}
		})
	}
}

func TestServiceConcurrent(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	const workers, each = 8, 10
	var wg sync.WaitGroup
	addrs := make([][]netip.Addr, workers)
	errs := make(chan error, workers*each)
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				k := key(w*each + i)
				a, _, err := svc.Allocate(context.Background(), k, Meta{})
				if err != nil {
					errs <- err
					return
				}
				if got, ok := svc.Lookup(k); !ok || got != a {
					errs <- fmt.Errorf("Lookup(%s) = %s, %v right after allocating %s", k, got, ok, a)
				}
				addrs[w] = append(addrs[w], a)
				_ = svc.Snapshot()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	seen := map[netip.Addr]bool{}
	for _, as := range addrs {
		for _, a := range as {
			if seen[a] {
				t.Fatalf("%s handed out twice", a)
			}
			seen[a] = true
		}
	}
}

const crashEnv = "WEFT_IPALLOC_CRASH_STATE_DIR"

// TestServiceCrashHelper is the child of TestServiceCrash: it allocates,
// prints each address once Allocate has returned, and waits to be killed.
func TestServiceCrashHelper(t *testing.T) {
	dir := os.Getenv(crashEnv)
	if dir == "" {
		t.Skip("the child process of TestServiceCrash; runs only under it")
	}
	e := &svcEnv{t: t, dir: dir, universe: "10.32.0.0/12"}
	e.mustStart()
	for i := range 3 {
		fmt.Printf("ADDR %d %s\n", i, e.mustAllocate(key(i)))
	}
	// Killed here. If the parent goes away instead, stdin closes.
	_, _ = io.Copy(io.Discard, os.Stdin)
	t.Fatal("the parent closed stdin without killing this process")
}

// TestServiceCrash kills a router-like child with SIGKILL right after it
// printed an address, and checks that the allocation survived: Allocate
// returns only once the allocation is on disk.
func TestServiceCrash(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestServiceCrashHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashEnv+"="+dir)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()

	want := map[int]netip.Addr{}
	sc := bufio.NewScanner(stdout)
	for len(want) < 3 && sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 3 || f[0] != "ADDR" {
			continue
		}
		i, err := strconv.Atoi(f[1])
		if err != nil {
			t.Fatalf("child printed %q", sc.Text())
		}
		want[i] = netip.MustParseAddr(f[2])
	}
	if len(want) < 3 {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		killed = true
		t.Fatalf("the child printed %d addresses, want 3; its stderr:\n%s", len(want), stderr.String())
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	killed = true
	var ee *exec.ExitError
	if !errors.As(err, &ee) || !ee.Sys().(syscall.WaitStatus).Signaled() || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the child ended with %v, not by SIGKILL; its stderr:\n%s", err, stderr.String())
	}

	e := &svcEnv{t: t, dir: dir, universe: "10.32.0.0/12"}
	svc := e.mustStart()
	for i, a := range want {
		if got, ok := svc.Lookup(key(i)); !ok || got != a {
			t.Errorf("after the crash, Lookup(%s) = %s, %v; want %s", key(i), got, ok, a)
		}
	}
	// And the next allocation does not reuse them.
	n := e.mustAllocate(key(10))
	for _, a := range want {
		if n == a {
			t.Fatalf("after the crash, %s was handed out again", a)
		}
	}
}

func BenchmarkServiceAllocate(b *testing.B) {
	e := newSvcEnv(b, "10.32.0.0/16")
	svc := e.mustStart()
	i := 0
	for b.Loop() {
		k := key(i % 1000)
		i++
		if _, _, err := svc.Allocate(context.Background(), k, Meta{PodName: "p"}); err != nil {
			b.Fatal(err)
		}
		if _, _, err := svc.Release(k); err != nil {
			b.Fatal(err)
		}
	}
}

// A state whose ring record went missing is refused with a clear error,
// and its allocations stay on disk: without the ring this peer cannot tell
// which addresses are its own, so handing any out could duplicate one.
func TestServiceRingRecordLost(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	e.mustStart()
	for _, id := range []string{"a", "b", "c"} {
		e.mustAllocate(Key{ContainerID: id, IfName: "eth0"})
	}
	if err := e.db.Update(bucketIPAM, func(b *bolt.Bucket) error { return b.Delete([]byte(keyRing)) }); err != nil {
		t.Fatal(err)
	}
	if err := e.db.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.start(); err == nil || !strings.Contains(err.Error(), "holds 3 allocations but no ring") {
		t.Fatalf("start without a ring record: %v", err)
	}
	n := 0
	if err := e.db.View(bucketAllocations, func(b *bolt.Bucket) error { return b.ForEach(func(_, _ []byte) error { n++; return nil }) }); err != nil || n != 3 {
		t.Fatalf("allocations on disk after the refusal: %d, %v; want 3", n, err)
	}
}
