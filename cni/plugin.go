package cni

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/weft-net/weft/api"
)

// defaultTimeout bounds one command's talk with the router.
const defaultTimeout = 30 * time.Second

// Options configure a Plugin. The zero value writes to the process's stdout
// and stderr and logs only where the network config's logFile says.
type Options struct {
	// Stdout receives the ADD result; os.Stdout when nil. Nothing else is
	// ever written to it: errors travel as the CNI error JSON that skel prints.
	Stdout io.Writer
	// Stderr receives GC's report of what it released; os.Stderr when nil.
	Stderr io.Writer
	// Logger, when set, is used instead of the config's logFile (tests).
	Logger *slog.Logger
	// Timeout bounds each command's calls to the router; 30s when zero.
	Timeout time.Duration
}

// Plugin runs the CNI commands of weft-cni.
type Plugin struct {
	stdout  io.Writer
	stderr  io.Writer
	logger  *slog.Logger
	timeout time.Duration
}

// New returns a Plugin with o's settings.
func New(o Options) *Plugin {
	p := &Plugin{stdout: o.Stdout, stderr: o.Stderr, logger: o.Logger, timeout: o.Timeout}
	if p.stdout == nil {
		p.stdout = os.Stdout
	}
	if p.stderr == nil {
		p.stderr = os.Stderr
	}
	if p.timeout <= 0 {
		p.timeout = defaultTimeout
	}
	return p
}

// Funcs are the plugin's commands for skel; VERSION is skel's own.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, GC: p.GC, Status: p.Status}
}

// Main runs weft-cni as a CNI plugin binary: it reads the command from the
// environment and the config from stdin, and exits 1 after printing a CNI
// error. buildVersion goes into the text shown when no command is set.
func Main(buildVersion string) {
	skel.PluginMainFuncs(New(Options{}).Funcs(), SupportedVersions(), "weft-cni "+buildVersion+": attaches pods to the weft network")
}

// context is the deadline for one command's calls to the router.
func (p *Plugin) context() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), p.timeout)
}

// log returns the logger for one command and a function that closes its file:
// the injected logger, else the config's logFile at its level, else nothing.
// A log file that cannot be opened is reported on stderr and does not fail
// the command: networking the pod matters more than its debug log.
func (p *Plugin) log(conf *NetConf, cmd string) (*slog.Logger, func()) {
	if p.logger != nil {
		return p.logger.With("cmd", cmd), func() {}
	}
	if conf == nil || conf.LogFile == "" {
		return slog.New(slog.DiscardHandler), func() {}
	}
	f, err := os.OpenFile(conf.LogFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		fmt.Fprintf(p.stderr, "weft-cni: cannot open logFile: %v\n", err)
		return slog.New(slog.DiscardHandler), func() {}
	}
	l := slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: conf.Level()}))
	return l.With("cmd", cmd, "pid", os.Getpid()), func() { _ = f.Close() }
}

// Status answers STATUS: nil when the router can attach pods, else
// ErrPluginNotAvailable (50) with the reason.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	log, done := p.log(conf, "STATUS")
	defer done()
	ctx, cancel := p.context()
	defer cancel()
	if err := api.NewClient(conf.Socket).Ready(ctx); err != nil {
		log.Info("weft router not available", "socket", conf.Socket, "err", err)
		return types.NewError(types.ErrPluginNotAvailable, "weft router is not ready to attach pods: "+err.Error(), "socket "+conf.Socket)
	}
	log.Debug("weft router ready", "socket", conf.Socket)
	return nil
}

// GC answers GC: the router releases every allocation of this node that is
// not in the config's cni.dev/valid-attachments. What it released goes to
// stderr and the log only; stdout stays empty.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	valid, err := validAttachments(conf)
	if err != nil {
		return err
	}
	log, done := p.log(conf, "GC")
	defer done()
	ctx, cancel := p.context()
	defer cancel()
	resp, err := api.NewClient(conf.Socket).GC(ctx, valid)
	if err != nil {
		return routerError(fmt.Sprintf("collecting garbage (%d valid attachments)", len(valid)), err)
	}
	for _, a := range resp.Released {
		log.Info("released stale address", "attachment", a.Attachment.String(), "address", a.Address)
		fmt.Fprintf(p.stderr, "weft-cni: GC released %s of %s\n", a.Address, a.Attachment)
	}
	log.Debug("GC done", "valid", len(valid), "released", len(resp.Released))
	return nil
}
