package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestMain lets the test binary act as the plugin binary: the tests below run
// it again with asPluginEnv set, so the real main and skel are exercised.
const asPluginEnv = "WEFT_CNI_TEST_RUN_AS_PLUGIN"

func TestMain(m *testing.M) {
	if os.Getenv(asPluginEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runPlugin runs the plugin with env and stdin, as a runtime does.
func runPlugin(t *testing.T, stdin string, env ...string) (stdout, stderr string, exitCode int) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append([]string{asPluginEnv + "=1", "PATH=" + os.Getenv("PATH")}, env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		exitCode = exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return out.String(), errOut.String(), exitCode
}

func TestVersion(t *testing.T) {
	out, _, code := runPlugin(t, "", "CNI_COMMAND=VERSION")
	if code != 0 {
		t.Fatalf("VERSION exited %d: %s", code, out)
	}
	var v struct {
		CNIVersion        string   `json:"cniVersion"`
		SupportedVersions []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("VERSION printed %q: %v", out, err)
	}
	want := []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}
	if !slices.Equal(v.SupportedVersions, want) {
		t.Fatalf("supported versions %v, want %v", v.SupportedVersions, want)
	}
}

func TestNoCommandPrintsAbout(t *testing.T) {
	out, errOut, code := runPlugin(t, "")
	if code != 0 || out != "" || !strings.Contains(errOut, "weft-cni") || !strings.Contains(errOut, "1.1.0") {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}

// cniError is the error JSON a plugin prints on stdout.
type cniError struct {
	Code uint   `json:"code"`
	Msg  string `json:"msg"`
}

func errorOf(t *testing.T, out string) cniError {
	t.Helper()
	var e cniError
	if err := json.Unmarshal([]byte(out), &e); err != nil || e.Msg == "" {
		t.Fatalf("stdout %q is not a CNI error: %v", out, err)
	}
	return e
}

func TestStatusWithoutRouter(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	conf := `{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","socket":"` + sock + `"}`
	out, _, code := runPlugin(t, conf, "CNI_COMMAND=STATUS", "CNI_PATH=/opt/cni/bin")
	if e := errorOf(t, out); code != 1 || e.Code != 50 {
		t.Fatalf("STATUS exited %d with %+v, want 1 with code 50", code, e)
	}
}

func TestBadConfig(t *testing.T) {
	conf := `{"cniVersion":"1.0.0","name":"weft","type":"weft-cni","socket":"relative.sock"}`
	out, _, code := runPlugin(t, conf, "CNI_COMMAND=DEL", "CNI_CONTAINERID=abc", "CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin")
	if e := errorOf(t, out); code != 1 || e.Code != 7 || !strings.Contains(e.Msg, "absolute") {
		t.Fatalf("DEL with a bad config exited %d with %+v", code, e)
	}
}

func TestOldConfigVersionRefused(t *testing.T) {
	conf := `{"cniVersion":"0.2.0","name":"weft","type":"weft-cni"}`
	out, _, code := runPlugin(t, conf, "CNI_COMMAND=DEL", "CNI_CONTAINERID=abc", "CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin")
	if e := errorOf(t, out); code != 1 || e.Code != 1 {
		t.Fatalf("DEL with cniVersion 0.2.0 exited %d with %+v, want incompatible version", code, e)
	}
}
