package nscluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// netnsDir is where iproute2 keeps named namespaces.
const netnsDir = "/run/netns"

// Netns is a named network namespace that a Run made with `ip netns add`.
// `ip netns exec <Name>` enters it.
type Netns struct {
	Name string // the name under /run/netns, e.g. "wftab3cd-n0"
	Path string // /run/netns/<Name>
}

func (n *Netns) String() string { return n.Name }

// Do runs fn on an OS thread that has entered the namespace (pkg/ns NetNS.Do).
// Sockets, links and processes that fn creates belong to the namespace. fn must
// not start goroutines that do namespace work: they run on other threads.
func (n *Netns) Do(fn func() error) error {
	return ns.WithNetNSPath(n.Path, func(ns.NetNS) error { return fn() })
}

// Exec runs argv inside the namespace and returns its combined output. A
// failure is an error that names the command and the namespace and carries
// the output.
func (n *Netns) Exec(ctx context.Context, argv ...string) ([]byte, error) {
	if len(argv) == 0 {
		return nil, errors.New("e2e: Exec needs a command")
	}
	var out []byte
	var runErr error
	err := n.Do(func() error {
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		out, runErr = cmd.CombinedOutput()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("entering netns %s: %w", n.Name, err)
	}
	if runErr != nil {
		return out, fmt.Errorf("%s in netns %s: %w: %s", strings.Join(argv, " "), n.Name, runErr, bytes.TrimSpace(out))
	}
	return out, nil
}

// WithHandle calls fn with a netlink handle that acts inside the namespace,
// without moving any thread (netlink.NewHandleAt).
func (n *Netns) WithHandle(fn func(h *netlink.Handle) error) error {
	nsh, err := netns.GetFromPath(n.Path)
	if err != nil {
		return fmt.Errorf("opening netns %s: %w", n.Name, err)
	}
	defer nsh.Close()
	h, err := netlink.NewHandleAt(nsh)
	if err != nil {
		return fmt.Errorf("netlink handle in netns %s: %w", n.Name, err)
	}
	defer h.Close()
	return fn(h)
}

// Inode is the namespace's inode number, the one /proc/<pid>/ns/net links name.
func (n *Netns) Inode() (uint64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(n.Path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", n.Path, err)
	}
	return st.Ino, nil
}

// Pids lists the processes whose main thread is in the namespace, like
// `ip netns pids`. The calling process is never listed.
func (n *Netns) Pids() ([]int, error) {
	ino, err := n.Inode()
	if err != nil {
		return nil, err
	}
	return pidsInNetns(ino)
}

// pidsInNetns scans /proc for live processes in the namespace with inode ino.
func pidsInNetns(ino uint64) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	want := fmt.Sprintf("net:[%d]", ino)
	self := os.Getpid()
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		link, err := os.Readlink(filepath.Join("/proc", e.Name(), "ns", "net"))
		if err != nil || link != want || isZombie(pid) {
			continue // gone meanwhile, a kernel thread, or not ours
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// isZombie reports whether pid has exited but is not reaped yet; a zombie holds
// no namespace.
func isZombie(pid int) bool {
	_, state, _, err := procStat(pid)
	return err == nil && state == "Z"
}

// procStat reads the command name, state and start time (in clock ticks after
// boot) of a process from /proc/<pid>/stat.
func procStat(pid int) (comm, state string, start uint64, err error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", "", 0, err
	}
	s := string(data)
	open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || closing < open {
		return "", "", 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	comm = s[open+1 : closing]
	fields := strings.Fields(s[closing+1:])
	// fields[0] is field 3 (state); the start time is field 22.
	if len(fields) < 20 {
		return "", "", 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	start, err = strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return "", "", 0, fmt.Errorf("malformed /proc/%d/stat: %w", pid, err)
	}
	return comm, fields[0], start, nil
}

// ipCmd runs iproute2's ip in the calling process's namespace. Only `ip netns`
// subcommands are run this way: they touch /run/netns, never the root
// namespace's network.
func ipCmd(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// createNetns makes a named namespace with its loopback up. It fails if the
// name is taken: a namespace that is not ours is never reused.
func createNetns(ctx context.Context, name string) (*Netns, error) {
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("iproute2's ip is needed to make namespaces (apt-get install iproute2): %w", err)
	}
	if err := ipCmd(ctx, "netns", "add", name); err != nil {
		return nil, err
	}
	n := &Netns{Name: name, Path: filepath.Join(netnsDir, name)}
	err := n.WithHandle(func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		return h.LinkSetUp(lo)
	})
	if err != nil {
		_ = deleteNetns(context.Background(), n, nil)
		return nil, fmt.Errorf("loopback up in netns %s: %w", name, err)
	}
	return n, nil
}

// killWait is how long deleteNetns waits for killed processes to go.
const killWait = 5 * time.Second

// deleteNetns kills every process left in the namespace and deletes it, which
// destroys the links in it. A namespace that is already gone is success.
func deleteNetns(ctx context.Context, n *Netns, warn func(msg string, args ...any)) error {
	if _, err := os.Stat(n.Path); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if pids, err := n.Pids(); err == nil && len(pids) > 0 {
		if warn != nil {
			warn("killing processes left in namespace", "netns", n.Name, "pids", pids)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if err := pollUntil(ctx, killWait, 20*time.Millisecond, func() bool {
			left, err := n.Pids()
			return err != nil || len(left) == 0
		}); err != nil && warn != nil {
			warn("processes still in namespace after SIGKILL", "netns", n.Name, "err", err)
		}
	}
	if err := ipCmd(ctx, "netns", "delete", n.Name); err != nil {
		if _, serr := os.Stat(n.Path); errors.Is(serr, fs.ErrNotExist) {
			return nil // deleted by someone else meanwhile
		}
		return err
	}
	return nil
}

// pollUntil calls cond every interval until it holds, ctx is done or max has
// passed.
func pollUntil(ctx context.Context, max, interval time.Duration, cond func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, max)
	defer cancel()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if cond() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
