package cni

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/cni/routertest"
)

// testPlugin is a Plugin writing into buffers, with a test log.
func testPlugin(t *testing.T) (p *Plugin, stdout, stderr *bytes.Buffer) {
	stdout, stderr = &bytes.Buffer{}, &bytes.Buffer{}
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	return New(Options{Stdout: stdout, Stderr: stderr, Logger: log}), stdout, stderr
}

// testWriter sends log lines to t.Log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

func confFor(socket, version string, extra string) []byte {
	return fmt.Appendf(nil, `{"cniVersion":%q,"name":"weft","type":"weft-cni","socket":%q%s}`, version, socket, extra)
}

func TestStatus(t *testing.T) {
	f := routertest.Start(t, "weft", 1376)
	p, stdout, _ := testPlugin(t)
	if err := p.Status(&skel.CmdArgs{StdinData: confFor(f.Socket, "1.1.0", "")}); err != nil {
		t.Fatalf("STATUS with a ready router: %v", err)
	}

	f.Set(func(f *routertest.Router) { f.NotReady = "no address space claimed yet" })
	err := p.Status(&skel.CmdArgs{StdinData: confFor(f.Socket, "1.1.0", "")})
	var te *types.Error
	if !errors.As(err, &te) || te.Code != types.ErrPluginNotAvailable || !strings.Contains(te.Msg, "no address space claimed yet") {
		t.Fatalf("STATUS with a router not ready: %v, want code 50 with the reason", err)
	}

	err = p.Status(&skel.CmdArgs{StdinData: confFor(filepath.Join(routertest.ShortTempDir(t), "none.sock"), "1.1.0", "")})
	if !errors.As(err, &te) || te.Code != types.ErrPluginNotAvailable || !strings.Contains(te.Msg, "unreachable") {
		t.Fatalf("STATUS with no router: %v, want code 50 saying unreachable", err)
	}
	if stdout.Len() != 0 {
		t.Fatalf("STATUS wrote to stdout: %q", stdout)
	}
}

func TestGC(t *testing.T) {
	f := routertest.Start(t, "weft", 1376)
	c := api.NewClient(f.Socket)
	keep := api.Attachment{ContainerID: "keep", IfName: "eth0"}
	stale := api.Attachment{ContainerID: "stale", IfName: "eth0"}
	for _, a := range []api.Attachment{keep, stale} {
		if _, err := c.Allocate(t.Context(), api.AllocateRequest{Attachment: a}); err != nil {
			t.Fatal(err)
		}
	}
	p, stdout, stderr := testPlugin(t)
	conf := confFor(f.Socket, "1.1.0", `,"cni.dev/valid-attachments":[{"containerID":"keep","ifname":"eth0"}]`)
	if err := p.GC(&skel.CmdArgs{StdinData: conf}); err != nil {
		t.Fatalf("GC: %v", err)
	}
	valid, calls := f.LastGC()
	if calls != 1 || len(valid) != 1 || valid[0] != keep {
		t.Fatalf("router got GC valid list %v (%d calls), want [%v]", valid, calls, keep)
	}
	if _, ok := f.Allocation(stale); ok {
		t.Error("stale allocation survived GC")
	}
	if _, ok := f.Allocation(keep); !ok {
		t.Error("valid allocation was released by GC")
	}
	if !strings.Contains(stderr.String(), "stale/eth0") || stdout.Len() != 0 {
		t.Errorf("GC report: stderr %q, stdout %q; want the release on stderr only", stderr, stdout)
	}

	// No attachments at all: an empty list, not a missing one.
	if err := p.GC(&skel.CmdArgs{StdinData: confFor(f.Socket, "1.1.0", "")}); err != nil {
		t.Fatalf("GC with no valid attachments: %v", err)
	}
	if valid, calls := f.LastGC(); calls != 2 || valid == nil || len(valid) != 0 {
		t.Fatalf("router got %v (%d calls), want an empty list", valid, calls)
	}

	// A garbled entry stops GC before the router is asked.
	err := p.GC(&skel.CmdArgs{StdinData: confFor(f.Socket, "1.1.0", `,"cni.dev/valid-attachments":[{"containerID":"","ifname":"eth0"}]`)})
	if cniCode(err) != types.ErrInvalidNetworkConfig {
		t.Fatalf("GC with a garbled entry: %v", err)
	}
	if _, calls := f.LastGC(); calls != 2 {
		t.Fatal("GC with a garbled entry reached the router")
	}

	err = p.GC(&skel.CmdArgs{StdinData: confFor(filepath.Join(routertest.ShortTempDir(t), "none.sock"), "1.1.0", "")})
	if cniCode(err) != types.ErrTryAgainLater {
		t.Fatalf("GC with no router: %v, want code 11", err)
	}
}

func TestLogFile(t *testing.T) {
	f := routertest.Start(t, "weft", 1376)
	logPath := filepath.Join(t.TempDir(), "cni.log")
	p := New(Options{Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}})
	conf := confFor(f.Socket, "1.1.0", fmt.Sprintf(`,"logFile":%q,"logLevel":"debug"`, logPath))
	if err := p.Status(&skel.CmdArgs{StdinData: conf}); err != nil {
		t.Fatal(err)
	}
	data, err := readFile(logPath)
	if err != nil || !strings.Contains(data, "weft router ready") {
		t.Fatalf("log file: %q, %v", data, err)
	}
}

func readFile(p string) (string, error) {
	b, err := os.ReadFile(p)
	return string(b), err
}
