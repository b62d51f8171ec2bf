// Package kubeapi starts a real Kubernetes control plane (etcd and
// kube-apiserver) for weft's tests, inside a network namespace of the test's
// own, and hands out identities on it: the admin, and any ServiceAccount
// through the TokenRequest API.
//
// The binaries are built from Go modules pinned in the nested module
// e2e/kubeapi/tools (k8s.io/kubernetes for kube-apiserver and kubectl,
// go.etcd.io/etcd/server for etcd), once, into a cache keyed by the hash of
// that module's go.mod and go.sum and the Go version:
//
//	${WEFT_TOOLS_CACHE:-/var/cache/weft-tools}/kube-<hash12>/{etcd,kube-apiserver,kubectl}
//
// A cold build takes several minutes on two cores; `make kube-tools` does it
// ahead of the tests. Binaries builds under a lock file and renames a
// finished build into place, so concurrent test binaries build once and a
// killed build never leaves a half cache.
//
// A test starts a server in a namespace of its own:
//
//	srv := kubeapi.Start(t, kubeapi.Options{})
//	out, err := srv.Kubectl(ctx, "get", "nodes")
//	cs, err := kubernetes.NewForConfig(srv.Config) // dials inside the namespace
//
// or in the underlay namespace of an e2e cluster, where every node reaches
// it at e2e.UnderlayGateway:
//
//	run := e2e.NewTestRun(t)
//	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: 3})
//	srv := kubeapi.Start(t, kubeapi.Options{Run: run, NetNS: c.Underlay, Address: e2e.UnderlayGateway})
//	err = srv.ApplyWeft(ctx)                                    // deploy/weft.yaml: the ServiceAccount and its RBAC
//	id, err := srv.ServiceAccount(ctx, "kube-system", "weft", 0) // a TokenRequest token and a kubeconfig
//	for _, n := range c.Nodes {
//		_, err = srv.CreateNode(ctx, n.Name, n.UnderlayIP) // no kubelet here: the test registers the Nodes
//		_, err = n.StartRouter("--kube", "--kubeconfig", id.Kubeconfig, "--node-name", n.Name)
//	}
//
// Nothing runs in the machine's own network namespace: etcd listens on
// 127.0.0.1 of the server's namespace and kube-apiserver on Options.Address
// there. Every process belongs to the e2e.Run and is stopped by its Close,
// which also deletes the namespace if the run made it.
package kubeapi
