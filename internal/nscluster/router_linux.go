package nscluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/weft-net/weft/api"
)

const (
	// stopGrace is how long Router.Stop waits after SIGTERM.
	stopGrace = 10 * time.Second
	// defaultReadyWait bounds WaitReady when the context has no deadline.
	defaultReadyWait = 30 * time.Second
	// pollInterval is how often conditions are polled.
	pollInterval = 100 * time.Millisecond
	// logTailLines is how much of a log errors and failed tests show.
	logTailLines = 40
	// routerBridge is the --bridge every router of a cluster uses.
	routerBridge = "weft"
	// ConfListFile is the conflist a ready router writes into --cni-conf-dir.
	ConfListFile = "10-weft.conflist"
)

// Router is a weft router running in a node's namespace.
type Router struct {
	Node *Node
	Args []string // the extra arguments given to StartRouter

	mu   sync.Mutex // guards proc
	proc *Proc
}

// RouterArgv is the command line StartRouter runs: the node's weft binary
// with the node's name, paths and addresses, then extra.
func (n *Node) RouterArgv(extra ...string) ([]string, error) {
	bin, err := n.Cluster.Run.Binary("weft")
	if err != nil {
		return nil, err
	}
	argv := []string{bin, "router",
		"--name", n.PeerName,
		"--nickname", n.Name,
		"--http-addr", n.HTTPAddr,
		"--socket", n.Socket,
		"--state-dir", n.StateDir,
		"--cni-bin-dir", n.CNIBinDir,
		"--cni-conf-dir", n.CNIConfDir,
		"--bridge", routerBridge,
	}
	return append(argv, extra...), nil
}

// StartRouter starts `weft router` inside the node's namespace with the
// node's paths and args appended (see RouterArgv). Its output goes to
// n.RouterLog; Close stops it. It does not wait for readiness: see WaitReady.
func (n *Node) StartRouter(args ...string) (*Router, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.router != nil && n.router.Proc().Running() {
		return nil, fmt.Errorf("e2e: node %s runs a router already (pid %d); Stop or Kill it first", n.Name, n.router.Proc().Pid())
	}
	r := &Router{Node: n, Args: append([]string(nil), args...)}
	if err := r.start(); err != nil {
		return nil, err
	}
	n.router = r
	return r, nil
}

// Router is the node's router, or nil if none was started.
func (n *Node) Router() *Router {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.router
}

func (r *Router) start() error {
	argv, err := r.Node.RouterArgv(r.Args...)
	if err != nil {
		return err
	}
	p, err := r.Node.Cluster.Run.Start(r.Node.NS, "router "+r.Node.Name, r.Node.RouterLog, argv...)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.proc = p
	r.mu.Unlock()
	return nil
}

// Proc is the current router process.
func (r *Router) Proc() *Proc {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc
}

// Kill kills the router with SIGKILL, as a crash or an OOM kill would.
func (r *Router) Kill() error { return r.Proc().Kill() }

// Stop asks the router to exit with SIGTERM and waits for it; a router that
// takes longer than 10s is killed and Stop says so.
func (r *Router) Stop() error { return r.Proc().Stop(stopGrace) }

// Restart stops the router (if it runs) and starts it again with the same
// arguments, state directory and log.
func (r *Router) Restart() error {
	if err := r.Stop(); err != nil {
		return err
	}
	return r.start()
}

// LogTail returns the last lines of the node's router log.
func (r *Router) LogTail(lines int) string { return tailFile(r.Node.RouterLog, lines) }

// WaitReady polls the router's readiness on its unix socket until it is
// ready, it exits, or ctx ends (30s when ctx has no deadline). Failures carry
// the last answer and the tail of the router's log.
func (r *Router) WaitReady(ctx context.Context) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultReadyWait)
		defer cancel()
	}
	p := r.Proc()
	c := api.NewClient(r.Node.Socket)
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	var last error
	for {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		last = c.Ready(actx)
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-p.Exited():
			return fmt.Errorf("e2e: router on node %s exited before it was ready (%v); last answer: %v\n--- %s ---\n%s",
				r.Node.Name, p.Wait(), last, r.Node.RouterLog, r.LogTail(logTailLines))
		case <-ctx.Done():
			return fmt.Errorf("e2e: router on node %s not ready: %w; last answer: %v\n--- %s ---\n%s",
				r.Node.Name, ctx.Err(), last, r.Node.RouterLog, r.LogTail(logTailLines))
		case <-t.C:
		}
	}
}

// WaitReady waits until the node's router is ready (Router.WaitReady) and has
// done what a ready router does for the runtime: weft-cni is in CNIBinDir and
// the conflist (ConfListFile) in CNIConfDir.
func (n *Node) WaitReady(ctx context.Context) error {
	r := n.Router()
	if r == nil {
		return fmt.Errorf("e2e: node %s has no router; StartRouter first", n.Name)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultReadyWait)
		defer cancel()
	}
	if err := r.WaitReady(ctx); err != nil {
		return err
	}
	want := []string{filepath.Join(n.CNIBinDir, "weft-cni"), filepath.Join(n.CNIConfDir, ConfListFile)}
	var missing string
	err := pollUntil(ctx, defaultReadyWait, pollInterval, func() bool {
		for _, f := range want {
			if _, err := os.Stat(f); err != nil {
				missing = f
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("e2e: router on node %s is ready but %s is missing: %w\n--- %s ---\n%s",
			n.Name, missing, err, n.RouterLog, r.LogTail(logTailLines))
	}
	return nil
}

// Weft runs the node's weft binary with args (e.g. "status", "connections")
// inside the node's namespace, where 127.0.0.1:6784 is this node's router,
// and returns its combined output.
func (n *Node) Weft(ctx context.Context, args ...string) ([]byte, error) {
	bin, err := n.Cluster.Run.Binary("weft")
	if err != nil {
		return nil, err
	}
	// The node's socket and status address reach the command through the
	// environment (WEFT_<FLAG>), as they would on an operator's shell.
	argv := append([]string{"env", "WEFT_SOCKET=" + n.Socket, "WEFT_HTTP_ADDR=" + n.HTTPAddr, bin}, args...)
	return n.NS.Exec(ctx, argv...)
}

// DialContext dials from inside the node's namespace: the socket is made on a
// thread that entered it, and can then be used from anywhere. addr must be an
// IP literal with a port (no name resolution happens inside).
func (n *Node) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	var dialErr error
	err := n.NS.Do(func() error {
		var d net.Dialer
		conn, dialErr = d.DialContext(ctx, network, addr)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return conn, dialErr
}

// HTTPClient is an HTTP client whose connections are made inside the node's
// namespace, so that http://127.0.0.1:6784/ is this node's status server.
func (n *Node) HTTPClient() *http.Client {
	return &http.Client{
		Transport: &http.Transport{DialContext: n.DialContext, DisableKeepAlives: true},
		Timeout:   10 * time.Second,
	}
}

// HTTPGet fetches path (e.g. "/status") from the node's status server and
// returns the body of a 2xx answer.
func (n *Node) HTTPGet(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+n.HTTPAddr+path, nil)
	if err != nil {
		return nil, fmt.Errorf("e2e: GET %s on node %s: %w", path, n.Name, err)
	}
	resp, err := n.HTTPClient().Do(req)
	if err != nil {
		return nil, fmt.Errorf("e2e: GET %s on node %s: %w", path, n.Name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("e2e: GET %s on node %s: %w", path, n.Name, err)
	}
	if resp.StatusCode/100 != 2 {
		return body, fmt.Errorf("e2e: GET %s on node %s: %s: %.300s", path, n.Name, resp.Status, body)
	}
	return body, nil
}

// tailFile returns the last lines of a file, or a note that it cannot be read.
func tailFile(path string, lines int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	defer f.Close()
	const max = 64 << 10
	if st, err := f.Stat(); err == nil && st.Size() > max {
		if _, err := f.Seek(-max, io.SeekEnd); err != nil {
			return fmt.Sprintf("(log unreadable: %v)", err)
		}
	}
	data, err := io.ReadAll(f)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Sprintf("(log unreadable: %v)", err)
	}
	return lastLines(string(data), lines)
}

// Gateway is the address of the node's bridge (its first address from the
// pod range), as the router reports it.
func (n *Node) Gateway(ctx context.Context) (netip.Addr, error) {
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return netip.Addr{}, err
	}
	var rep struct {
		Router struct {
			Gateway string `json:"gateway"`
		} `json:"router"`
	}
	if err := json.Unmarshal(data, &rep); err != nil {
		return netip.Addr{}, fmt.Errorf("e2e: %s's /report: %w", n.Name, err)
	}
	a, err := netip.ParseAddr(rep.Router.Gateway)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("e2e: %s has no gateway yet (%q)", n.Name, rep.Router.Gateway)
	}
	return a, nil
}
