// Package nscluster builds weft test clusters on one machine out of network
// namespaces, and drives them the way a node's container runtime would.
//
// It is a library, not a test: the e2e tests of several packages, the cnibench
// program and `weft demo` use it. Everything it creates belongs to a Run, which
// removes it all in reverse order on Close:
//
//	run := nscluster.NewTestRun(t) // or nscluster.NewRun(nscluster.Options{Log: logger}) + defer run.Close()
//	c, err := run.NewCluster(ctx, nscluster.ClusterOpts{Nodes: 2})
//	n := c.Nodes[0]
//	r, err := n.StartRouter("--ipalloc-init", "consensus=2")
//	err = n.WaitReady(ctx)                // router ready and its conflist written
//	p, err := n.AddPod(ctx, "p1")         // CNI ADD through libcni, run in the node's namespace
//	err = nscluster.Ping(ctx, p.NS, c.Nodes[1].UnderlayIP)
//	fmt.Print(nscluster.PingMatrix(ctx, pods))
//
// A program cancels its work on SIGINT/SIGTERM and closes the run on return:
//
//	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
//	defer stop() // runs after Close: a second Ctrl-C cannot cut Close short
//	run, err := nscluster.NewRun(nscluster.Options{Log: logger})
//	if err != nil { ... }
//	defer run.Close()
//
// # Names
//
// Every run has a short random prefix ("wft" and five base32 characters).
// Namespaces are made with `ip netns add` and are named <prefix>-<node> for
// nodes, <prefix>-<node>-<pod> for pods and <prefix>-ul for the underlay, so
// they show in `ip netns list` and `ip netns exec` enters them. Files live in
// one temporary directory per run, one subdirectory per node.
//
// # The underlay
//
// All nodes of a cluster hang off one bridge in the underlay namespace. Node i
// gets eth0 with 10.250.0.(i+1)/24 and a default route via 10.250.0.254, the
// bridge's address, so that a router finds its host address and MTU from the
// default route as it would on a real machine.
//
// # Cleaning up
//
// Close kills the processes, deletes the namespaces (which destroys the veths
// in them) and removes the directories, in the reverse order of creation, on
// every exit path: tests get it from t.Cleanup, programs defer it and cancel
// their context on SIGINT/SIGTERM. Against a kill -9 of the test process,
// daemons are started with Pdeathsig (from an OS thread that stays locked for
// the life of the daemon, since Pdeathsig fires when the parent thread exits),
// and every run records its owner's pid and start time under
// /run/weft-e2e/<prefix>; the next Run sweeps the namespaces and directories
// of runs whose owner is gone. Nothing that is not recorded as a run's is ever
// deleted.
//
// # Binaries
//
// Routers are started from the directory of weft binaries: Options.BinDir,
// else $WEFT_BIN_DIR, else the running program's directory if a weft binary
// is there (an installed `weft demo`), else bin/ at the root of the module
// found by walking up from the working directory (tests; `make build` fills
// it). The package never
// builds them itself; a missing binary is an error that says to run
// `make build`.
package nscluster
