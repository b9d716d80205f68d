// Write to storage under a lock: send the request through the sidecar's
// egress proxy with `Fencing-Lease: <lease_id>`. The proxy adds the signed
// fencing token; the gateway in front of the storage refuses any write whose
// token is older than one it has already accepted for the key.
// Run: java ProxyWrite.java   (JDK 17+, no dependencies)
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpRequest.BodyPublishers;
import java.net.http.HttpResponse.BodyHandlers;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class ProxyWrite {
    static final String API = System.getenv().getOrDefault("FENCER_API", "http://127.0.0.1:7411");
    static final String PROXY = System.getenv().getOrDefault("FENCER_PROXY", "http://127.0.0.1:7412");
    static final String KEY = "example:write";
    static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

    /** An error answer of fencer: {"error": code, "message": text}. */
    static class FencerException extends RuntimeException {
        final String code;

        FencerException(int status, String body) {
            super(status + " " + field(body, "error") + ": " + field(body, "message"));
            code = field(body, "error");
        }
    }

    static String call(String method, String url, String json, String... headers) throws Exception {
        var req = HttpRequest.newBuilder(URI.create(url))
                .header("Content-Type", "application/json")
                .method(method, json == null ? BodyPublishers.noBody() : BodyPublishers.ofString(json));
        if (headers.length > 0) req.headers(headers);
        var res = HTTP.send(req.build(), BodyHandlers.ofString());
        if (res.statusCode() != 200) throw new FencerException(res.statusCode(), res.body());
        return res.body();
    }

    /** The first string or number field so named; use your JSON library in real code. */
    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*(?:\"([^\"]*)\"|([^,}\\s]+))").matcher(json);
        return !m.find() ? null : m.group(1) != null ? m.group(1) : m.group(2);
    }

    public static void main(String[] args) throws Exception {
        try {
            String lease = call("POST", API + "/v1/locks/" + KEY + "/acquire", "{\"ttl_ms\": 10000, \"wait_ms\": 5000}");
            String leaseId = field(lease, "lease_id");
            System.out.println("acquired token=" + field(lease, "token"));
            try {
                call("PUT", PROXY + "/kv/example/write", "{\"balance\": 100}", "Fencing-Lease", leaseId);
                System.out.println("write ok");
                String read = call("GET", PROXY + "/kv/example/write", null, "Fencing-Lease", leaseId);
                System.out.println("read back balance=" + field(read, "balance")); // {"value":{"balance":100},…}
            } finally {
                call("POST", API + "/v1/locks/" + KEY + "/release", "{\"lease_id\": \"" + leaseId + "\"}");
                System.out.println("released");
            }
        } catch (FencerException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(1);
        } catch (java.io.IOException e) {
            System.err.println("error: cannot reach fencer: " + e);
            System.exit(1);
        }
    }
}
