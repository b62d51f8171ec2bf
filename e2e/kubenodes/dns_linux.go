package kubenodes

import (
	"context"
	_ "embed"
	"fmt"
	"strings"
	"time"
)

// DNSServiceIP is the kube-dns Service's ClusterIP (in the API server's
// service range, kubeapi.DefaultServiceCIDR): the kubelets' clusterDNS
// with Options.ClusterDNS.
const DNSServiceIP = "10.96.0.10"

// DNSImage is the name the CoreDNS image is imported under
// (conformance.ProgramImage) and the manifest runs.
const DNSImage = "weft-e2e/coredns:1.15.0"

//go:embed coredns.yaml
var corednsManifest string

// DNSManifest is coredns.yaml with the image and the Service address.
func DNSManifest(image, clusterIP string) string {
	return strings.NewReplacer("image: IMAGE", "image: "+image, "clusterIP: CLUSTER_IP", "clusterIP: "+clusterIP).Replace(corednsManifest)
}

// DeployDNS applies the cluster DNS (DNSManifest of DNSImage, which
// Options.Images must have imported) and waits until its Deployment has
// rolled out: CoreDNS's readiness is its ready plugin's, which answers
// once the kubernetes plugin has read Services and EndpointSlices, so the
// names resolve from then on. It needs the pod network (weft) up.
func (c *Cluster) DeployDNS(ctx context.Context) error {
	if !c.opts.ClusterDNS {
		return fmt.Errorf("kubenodes: DeployDNS on a cluster without Options.ClusterDNS: the kubelets would not point pods at it")
	}
	if _, err := c.API.KubectlIn(ctx, nil, c.API.Admin.Kubeconfig, []byte(DNSManifest(DNSImage, DNSServiceIP)), "apply", "-f", "-"); err != nil {
		return fmt.Errorf("kubenodes: applying the cluster DNS: %w", err)
	}
	out, err := c.API.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout="+(3*time.Minute).String())
	if err != nil {
		return fmt.Errorf("kubenodes: the cluster DNS (CoreDNS) did not become ready: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}
