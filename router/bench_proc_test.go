package router

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/weft-net/weft/api"
)

// The environment of the load process of BenchmarkLocalAPIAllocate20Proc.
const (
	loadEnvSocket  = "WEFT_BENCH_LOAD_SOCKET"
	loadEnvN       = "WEFT_BENCH_LOAD_N"
	loadEnvClients = "WEFT_BENCH_LOAD_CLIENTS"
	loadEnvOut     = "WEFT_BENCH_LOAD_OUT"
)

// BenchmarkLocalAPIAllocate20Proc is BenchmarkLocalAPIAllocate20 with the
// 20 clients in a process of their own, as on a node, where every CNI ADD
// is a weft-cni process and the router another: the router's runtime
// (its scheduler, its heap and collector) serves only the router, and the
// clients' garbage and goroutines are not its own. The clients still share
// the machine's 2 cores with it. It reports p50, p99 and max of the
// latency each client measured, and the CPU per ADD of the router's
// process and of the clients' process.
//
//	go test ./router -run '^$' -bench LocalAPIAllocate20Proc -benchtime 8000x
func BenchmarkLocalAPIAllocate20Proc(b *testing.B) {
	const clients = 20
	r, _ := newTestRouter(b, "10.32.0.0/12")
	r.setReady(true, "")
	runAllocator(b, r)

	out := filepath.Join(b.TempDir(), "latencies")
	cmd := exec.Command(os.Args[0], "-test.run=^TestLocalAPILoadProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(),
		loadEnvSocket+"="+r.cfg.Socket,
		loadEnvN+"="+strconv.Itoa(b.N),
		loadEnvClients+"="+strconv.Itoa(clients),
		loadEnvOut+"="+out)
	var before syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &before); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	outb, err := cmd.CombinedOutput()
	b.StopTimer()
	if err != nil {
		b.Fatalf("the load process: %v\n%s", err, outb)
	}
	var after syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &after); err != nil {
		b.Fatal(err)
	}
	lat := readLatencies(b, out)
	if len(lat) != b.N {
		b.Fatalf("the load process timed %d ADDs, want %d\n%s", len(lat), b.N, outb)
	}
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	cpu := func(ru *syscall.Rusage) time.Duration {
		return time.Duration(syscall.TimevalToNsec(ru.Utime) + syscall.TimevalToNsec(ru.Stime))
	}
	b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
	b.ReportMetric(ms(lat[(len(lat)*99)/100]), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "allocs/s")
	b.ReportMetric(ms(cpu(&after)-cpu(&before))/float64(b.N), "router-cpu-ms/op")
	if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
		b.ReportMetric(ms(cpu(ru))/float64(b.N), "clients-cpu-ms/op")
	}
}

func readLatencies(b *testing.B, path string) []time.Duration {
	b.Helper()
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	var lat []time.Duration
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		ns, err := strconv.ParseInt(sc.Text(), 10, 64)
		if err != nil {
			b.Fatalf("%s: %v", path, err)
		}
		lat = append(lat, time.Duration(ns))
	}
	if err := sc.Err(); err != nil {
		b.Fatal(err)
	}
	return lat
}

// TestLocalAPILoadProcess is the load process of
// BenchmarkLocalAPIAllocate20Proc, not a test: run without its
// environment, it skips. It makes N ADDs through the local API from
// CLIENTS goroutines at once, each with a new connection (api.Client, as
// weft-cni), and writes each one's latency in nanoseconds to OUT.
func TestLocalAPILoadProcess(t *testing.T) {
	sock := os.Getenv(loadEnvSocket)
	if sock == "" {
		t.Skip("the load process of BenchmarkLocalAPIAllocate20Proc; runs only under it")
	}
	n, err := strconv.Atoi(os.Getenv(loadEnvN))
	if err != nil {
		t.Fatal(err)
	}
	clients, err := strconv.Atoi(os.Getenv(loadEnvClients))
	if err != nil {
		t.Fatal(err)
	}
	cl := api.NewClient(sock)
	lat := make([]time.Duration, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	ctx := context.Background()
	for range clients {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				att := api.Attachment{ContainerID: fmt.Sprintf("proc-%d", i), IfName: "eth0"}
				start := time.Now()
				_, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID})
				lat[i] = time.Since(start)
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	f, err := os.Create(os.Getenv(loadEnvOut))
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(f)
	for _, d := range lat {
		fmt.Fprintln(w, int64(d))
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
