package e2e_test

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/e2e"
)

// fakeWeft stands in for the weft binary until the real router exists: the
// test binary runs it when it is started as ".../weft" (a symlink in a bin
// dir of the test's own). It keeps the router's contract as far as the
// harness sees it: the flags, readiness on the unix socket, a status server
// on --http-addr, and once ready a plugin in --cni-bin-dir (the reference
// bridge plugin, renamed weft-cni) and 10-weft.conflist in --cni-conf-dir.
func fakeWeft(args []string) int {
	if len(args) > 0 {
		switch args[0] {
		case "router":
			return fakeRouter(args[1:])
		case "status":
			return fakeStatus()
		}
	}
	fmt.Fprintln(os.Stderr, "usage: weft router|status")
	return 2
}

func fakeRouter(args []string) int {
	fs := flag.NewFlagSet("weft router", flag.ContinueOnError)
	name := fs.String("name", "", "")
	nick := fs.String("nickname", "", "")
	httpAddr := fs.String("http-addr", "", "")
	socket := fs.String("socket", "", "")
	stateDir := fs.String("state-dir", "", "")
	cniBin := fs.String("cni-bin-dir", "", "")
	cniConf := fs.String("cni-conf-dir", "", "")
	bridge := fs.String("bridge", "", "")
	readyAfter := fs.Duration("ready-after", 300*time.Millisecond, "")
	failStart := fs.Bool("fail-start", false, "")
	ignoreTerm := fs.Bool("ignore-term", false, "")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fmt.Printf("fake router %s (%s) starting, bridge %s\n", *nick, *name, *bridge)
	if *failStart {
		fmt.Fprintln(os.Stderr, "fake router: refusing to start, as asked")
		return 1
	}
	// Count starts in the state dir, to show that it survives a restart.
	countFile := filepath.Join(*stateDir, "starts")
	data, _ := os.ReadFile(countFile)
	starts, _ := strconv.Atoi(string(data))
	starts++
	if err := os.WriteFile(countFile, []byte(strconv.Itoa(starts)), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}

	_ = os.Remove(*socket)
	ul, err := net.Listen("unix", *socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	hl, err := net.Listen("tcp", *httpAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var ready atomic.Bool
	time.AfterFunc(*readyAfter, func() {
		if err := fakeInstall(*cniBin, *cniConf, *bridge, *stateDir); err != nil {
			fmt.Fprintln(os.Stderr, "fake router: installing the plugin:", err)
			return
		}
		ready.Store(true)
		fmt.Println("fake router: ready")
	})

	local := http.NewServeMux()
	local.HandleFunc(api.PathReady, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if !ready.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_ = json.NewEncoder(w).Encode(api.ErrorBody{Code: api.CodeNotReady, Message: "fake router warming up"})
			return
		}
		_ = json.NewEncoder(w).Encode(api.Readiness{Ready: true})
	})
	status := http.NewServeMux()
	status.HandleFunc("/status", func(w http.ResponseWriter, _ *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{"name": *name, "nickname": *nick, "starts": starts})
	})
	go func() { _ = http.Serve(ul, local) }()
	go func() { _ = http.Serve(hl, status) }()

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	for range sig {
		if !*ignoreTerm {
			break
		}
		fmt.Println("fake router: ignoring SIGTERM, as asked")
	}
	fmt.Println("fake router: stopping")
	ul.Close()
	hl.Close()
	return 0
}

// fakeInstall does what a ready router does for the runtime.
func fakeInstall(binDir, confDir, bridge, stateDir string) error {
	for dst, src := range map[string]string{"weft-cni": "bridge", "host-local": "host-local", "portmap": "portmap"} {
		data, err := os.ReadFile(filepath.Join(e2e.RefPluginDir, src))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(binDir, dst), data, 0o755); err != nil {
			return err
		}
	}
	conf, err := json.Marshal(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "weft",
		"plugins": []any{map[string]any{
			"type": "weft-cni", "bridge": bridge, "isGateway": true,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  [][]map[string]string{{{"subnet": "10.32.0.0/24"}}},
				"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
				"dataDir": filepath.Join(stateDir, "ipam"),
			},
		}},
	})
	if err != nil {
		return err
	}
	tmp := filepath.Join(confDir, ".10-weft.conflist.tmp")
	if err := os.WriteFile(tmp, conf, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(confDir, e2e.ConfListFile))
}

// fakeStatus prints the status of the router on this node's loopback.
func fakeStatus() int {
	resp, err := http.Get("http://" + e2e.StatusAddr + "/status")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer resp.Body.Close()
	_, _ = io.Copy(os.Stdout, resp.Body)
	return 0
}
