package kubenodes

import (
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A run killed before its cleanup leaves a record; the next run kills what
// is left in its cgroups, removes them and deletes the record. A live run's
// record makes the next one refuse to start.
func TestSweepHostCleansUpADeadRun(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("kubenodes: needs root for cgroups")
	}
	pids := filepath.Join(cgroupBase, "pids")
	if _, err := os.Stat(filepath.Join(pids, "cgroup.procs")); err != nil {
		t.Skipf("kubenodes: no cgroup v1 pids hierarchy at %s", pids)
	}
	oldBase := recordBase
	recordBase = t.TempDir()
	t.Cleanup(func() { recordBase = oldBase })

	// A dead run's node cgroup with a process still in it (below a child
	// cgroup, as a kubelet's pods are).
	root := filepath.Join(pids, "wftkntest"+strconv.Itoa(os.Getpid()))
	child := filepath.Join(root, "kubepods")
	if err := os.MkdirAll(child, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = removeCgroupTree(root) })
	sleep := exec.Command("sleep", "300")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = sleep.Wait(); close(exited) }()
	t.Cleanup(func() { _ = sleep.Process.Kill(); <-exited })
	if err := os.WriteFile(filepath.Join(child, "cgroup.procs"), []byte(strconv.Itoa(sleep.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	panicNow, err := readSysctl("kernel.panic")
	if err != nil {
		t.Fatal(err)
	}
	dead := hostRecord{Prefix: "wftdead", Pid: 1 << 30, StartTick: 1, // above any pid_max: its owner is gone
		Sysctls: map[string]string{"kernel.panic": panicNow}, Cgroups: []string{root}}
	writeRecord(t, dead)

	if err := sweepHost(slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("the process in the dead run's cgroup is still running")
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Fatalf("the dead run's cgroup %s is still there (%v)", root, err)
	}
	if files, _ := filepath.Glob(filepath.Join(recordBase, "*.json")); len(files) != 0 {
		t.Fatalf("records left: %v", files)
	}

	// A live run (this process) blocks a second one.
	tick, err := startTick(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	writeRecord(t, hostRecord{Prefix: "wftlive", Pid: os.Getpid(), StartTick: tick})
	err = sweepHost(slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), "is live") {
		t.Fatalf("sweep beside a live run: %v, want a refusal", err)
	}
}

func writeRecord(t *testing.T, rec hostRecord) {
	t.Helper()
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(recordBase, rec.Prefix+".json"), data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// A mount namespace's processes are killed by inode.
func TestKillMountNS(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("kubenodes: needs root for mount namespaces")
	}
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	var st, mine syscall.Stat_t
	path := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/ns/mnt"
	if err := syscall.Stat("/proc/self/ns/mnt", &mine); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(func() bool { return syscall.Stat(path, &st) == nil && st.Ino != mine.Ino }); err != nil {
		t.Fatalf("unshare made no mount namespace: %v", err)
	}
	if err := killMountNS([]uint64{st.Ino}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("the process in the mount namespace is still running")
	}
}

func waitFor(cond func() bool) error {
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			return os.ErrDeadlineExceeded
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}
