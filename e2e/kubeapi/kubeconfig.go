package kubeapi

import (
	"fmt"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// writeKubeconfig writes a kubeconfig with one cluster (server, verified
// with caData), one user (a bearer token) and a current context joining them,
// readable by its owner only since it holds a credential.
func writeKubeconfig(path, server string, caData []byte, user, token string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["weft-test"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caData}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["weft-test"] = &clientcmdapi.Context{Cluster: "weft-test", AuthInfo: user}
	cfg.CurrentContext = "weft-test"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("kubeapi: writing kubeconfig %s: %w", path, err)
	}
	return nil
}
