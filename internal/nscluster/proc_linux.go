package nscluster

import (
	"debug/buildinfo"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// closeGrace is how long Close lets a daemon shut down after SIGTERM before
// SIGKILL.
const closeGrace = 3 * time.Second

// raceSlowdown is how much longer a race-built daemon is given to stop.
const raceSlowdown = 4

// raceBuilt reports whether the program at path was built with -race
// (make build-race): it runs several times slower.
func raceBuilt(path string) bool {
	if v, ok := raceBuilds.Load(path); ok {
		return v.(bool)
	}
	race := false
	if bi, err := buildinfo.ReadFile(path); err == nil {
		for _, s := range bi.Settings {
			if s.Key == "-race" && s.Value == "true" {
				race = true
			}
		}
	}
	raceBuilds.Store(path, race)
	return race
}

var raceBuilds sync.Map // path -> raceBuilt

// Proc is a long-running process that a Run started inside a namespace.
type Proc struct {
	Name    string   // for messages, e.g. "router n0"
	Argv    []string // the command line
	NS      *Netns
	LogPath string // stdout and stderr, appended

	pid  int
	done chan struct{}
	err  error // the result of Wait; written before done is closed
}

// Start runs argv inside ns with stdout and stderr appended to logPath, and
// registers it with the run so that Close stops it.
//
// The process is forked from an OS thread that entered ns (NetNS.Do) and
// stays locked to that goroutine until the process exits, and it has
// Pdeathsig SIGKILL: Pdeathsig fires when the parent thread ends, so the
// thread must live as long as the process, and with it the process dies when
// the test process is killed, even by kill -9. It runs in its own process
// group, so that a Ctrl-C meant for the test or the demo reaches the daemon
// only through Close.
func (r *Run) Start(ns *Netns, name, logPath string, argv ...string) (*Proc, error) {
	if len(argv) == 0 {
		return nil, errors.New("e2e: Start needs a command")
	}
	lf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("e2e: log of %s: %w", name, err)
	}
	defer lf.Close() // the child has its own copy once started
	r.addLogFile(logPath)
	fmt.Fprintf(lf, "=== %s: starting in netns %s: %s\n", time.Now().Format(time.RFC3339Nano), ns.Name, strings.Join(argv, " "))

	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	p := &Proc{Name: name, Argv: argv, NS: ns, LogPath: logPath, done: make(chan struct{})}
	started := make(chan error, 1)
	go p.routineRun(cmd, started)
	if err := <-started; err != nil {
		return nil, fmt.Errorf("e2e: starting %s (%s) in netns %s: %w", name, argv[0], ns.Name, err)
	}
	r.log.Info("process started", "name", name, "pid", p.pid, "netns", ns.Name, "log", logPath)
	grace := closeGrace
	if raceBuilt(argv[0]) {
		grace *= raceSlowdown
	}
	r.Defer(fmt.Sprintf("stop %s (pid %d)", name, p.pid), func() error { return p.Stop(grace) })
	return p, nil
}

// routineRun starts cmd inside the namespace and waits for it on the same
// locked thread. It sends the start result on started, then ends when the
// process exits.
func (p *Proc) routineRun(cmd *exec.Cmd, started chan<- error) {
	defer close(p.done)
	didStart := false
	err := p.NS.Do(func() error {
		if err := cmd.Start(); err != nil {
			return err
		}
		didStart = true
		p.pid = cmd.Process.Pid
		started <- nil
		p.err = cmd.Wait()
		return nil
	})
	if !didStart {
		p.err = err
		started <- err
	}
}

// Pid is the process id.
func (p *Proc) Pid() int { return p.pid }

// Exited is closed when the process has exited and been reaped.
func (p *Proc) Exited() <-chan struct{} { return p.done }

// Running reports whether the process has not exited yet.
func (p *Proc) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Wait waits for the process to exit and returns how it ended.
func (p *Proc) Wait() error {
	<-p.done
	return p.err
}

// signal sends sig to the process group, which reaches what the process
// started too. After the process is reaped its pid may be reused, so then
// nothing is sent.
func (p *Proc) signal(sig syscall.Signal) {
	if p.Running() {
		_ = syscall.Kill(-p.pid, sig)
	}
}

// killWaitMax bounds the wait for a SIGKILLed process; only a process stuck
// in the kernel takes longer.
const killWaitMax = 10 * time.Second

// Kill sends SIGKILL and waits for the process to go.
func (p *Proc) Kill() error {
	p.signal(syscall.SIGKILL)
	select {
	case <-p.done:
		return nil
	case <-time.After(killWaitMax):
		return fmt.Errorf("e2e: %s (pid %d) still there %s after SIGKILL", p.Name, p.pid, killWaitMax)
	}
}

// Stop sends SIGTERM and waits up to grace for the process to exit; then it
// kills it and reports that it did not stop in time. A process that has
// already exited is success.
func (p *Proc) Stop(grace time.Duration) error {
	if !p.Running() {
		return nil
	}
	p.signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
		return nil
	case <-t.C:
	}
	if err := p.Kill(); err != nil {
		return err
	}
	return fmt.Errorf("e2e: %s (pid %d) did not exit within %s of SIGTERM and was killed", p.Name, p.pid, grace)
}
